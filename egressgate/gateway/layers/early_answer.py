"""A request refused at its headers is answered at once, before its body is read, whatever the body.

mitmproxy answers a response set in the `requestheaders` hook only after it has read (and buffered) the
whole request body, and it first answers `Expect: 100-continue` with `100 Continue`, inviting that body.
The gateway used to kill such flows when the body was chunked or larger than 64 KiB (so as not to buffer
it): the deny was decided and audited, but curl printed mitmproxy's HTML `400` ("peer closed connection
without sending complete message body" / "incomplete chunked read"), requests hung or raised
`SSLEOFError`, twine got `RemoteDisconnected` (issue 21 item 2, issue 23 item 6).

`EarlyAnswerStream` (the base of every gateway HTTP stream, http_layer.py) takes over right after the
`requestheaders` hook when an addon set `flow.response` and a body is still to come:

* no `100 Continue` is sent: a client that waits for it (curl above 1 MiB) gets the deny instead and never
  sends the body; while the `requestheaders` hooks decide, the connection is not read (a client that
  does not wait would otherwise have its body queued in the gateway's memory meanwhile);
* the `request` hook runs (as for a buffered body: addons finish their bookkeeping, e.g. budgets.py),
  then the response hooks, and the answer goes out at once — the body is never buffered;
* the stream ends there; whatever of the body still arrives is discarded by the connection layer, which
  closes in a way clients read: HTTP/1 lingers (http1_framing.py: FIN after the response, read and
  discard up to LINGER_MAX_BYTES / LINGER_SECONDS, then close), HTTP/2 keeps discarding the stream's DATA
  up to the same bounds and then resets it with NO_ERROR (h2_limits.py).

Nothing of the request goes upstream: the answer is set before any upstream connection is asked for.

The same ending serves a streamed body refused midway — the byte budget cut it (counters.out_counter flags
the cut and drops the crossing chunk) or the phantom guard found a placeholder credential in it
(misuse.stream_misuse): the upstream request is aborted before its end (HTTP/1: connection closed
before the body's end; HTTP/2: stream reset), and the client is answered with the deny contract (429
`budget_exceeded`, `state_unavailable` when the store failed, 403 `credential_misuse`) instead of a reset,
unless the upstream's own response is already on its way: then the flow is reset as before.
"""

from __future__ import annotations

import time

from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers.http import SendHttp
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestHeaders, RequestProtocolError, ResponseProtocolError
from mitmproxy.proxy.layers.http._hooks import HttpRequestHeadersHook, HttpRequestHook, HttpResponseHeadersHook

from egressgate.gateway.shared.compose import buffer_body
from egressgate.gateway.shared.context import flow_state
from egressgate.gateway.shared.counters import hold_client
from egressgate.gateway.shared.deny import deny_response, gateway_deny
from egressgate.gateway.tunnels.tunnel_close import HalfCloseTunnel
from egressgate.policy.reasons import Reason


class EarlyAnswerStream(HalfCloseTunnel):
    _gateway_answered = False  # the stream ended with the gateway's own answer

    def state_wait_for_request_headers(self, event: RequestHeaders) -> layer.CommandGenerator[None]:
        """mitmproxy's own state, driven step by step: right after its `requestheaders` hook, an answer
        set there for a request whose body is still to come is sent now (module docstring) instead of
        letting mitmproxy send `100 Continue` and read the body first."""
        steps = super().state_wait_for_request_headers(event)
        reply = None
        while True:
            try:
                command = steps.send(reply)
            except StopIteration as done:
                return done.value
            hook = isinstance(command, HttpRequestHeadersHook)
            # while the decision is made, the sandbox's connection is not read: mitmproxy would queue the
            # body it keeps sending in memory (counters.hold_client); the socket buffers push back instead
            resume = hold_client(self.context.client.id) if hook and not event.end_stream else None
            try:
                reply = yield command
            finally:
                if resume is not None:
                    resume()
            if hook and self._answered_before_body(event):
                steps.close()
                yield from self._answer_before_body()
                return

    def _answered_before_body(self, event: RequestHeaders) -> bool:
        """An addon answered, the flow was not killed nor refused by mitmproxy (`flow.error`: its own
        validation paths run this hook too), and a body is still to come."""
        return (
            not event.end_stream
            and self.flow.response is not None
            and self.flow.error is None
            and self.flow.request.method.upper() != "CONNECT"
        )

    def _answer_before_body(self) -> layer.CommandGenerator[None]:
        self.client_state = self.state_discard_request_body
        self.server_state = self.state_wait_for_response_headers
        buffer_body(self.flow.request)
        self.flow.request.timestamp_end = time.time()
        yield HttpRequestHook(self.flow)  # as after a buffered body: nothing of it is forwarded
        if (yield from self.check_killed(True)):
            return
        assert self.flow.response is not None  # a `request` hook may replace the answer, never remove it
        yield from self._send_answer()

    def cut_mid_body(self) -> layer.CommandGenerator[None]:
        """The byte budget or the phantom guard cut this streamed body (module docstring); called once,
        right after the chunk that crossed it was dropped."""
        fs = flow_state(self.flow)
        yield SendHttp(RequestProtocolError(self.stream_id, "cut by the gateway", ErrorCode.KILL), self.context.server)
        self.client_state = self.state_discard_request_body
        if self.flow.response is not None or fs is None:  # the upstream already answers: no clean answer
            self.flow.kill()
            yield from self.check_killed(True)
            return
        if fs.decision is not None and not fs.decision.allowed:  # decided mid-body (a phantom credential)
            refusal = fs.decision
        elif fs.state_cut:
            refusal = gateway_deny(Reason.STATE_UNAVAILABLE, detail="outbound_bytes_max")
        else:
            refusal = gateway_deny(
                Reason.BUDGET_EXCEEDED,
                detail="outbound_bytes_max",
                rule_id=fs.decision.rule_id if fs.decision is not None else None,
            )
        self.flow.response = deny_response(refusal, fs.request_id)
        self.flow.request.timestamp_end = time.time()  # the flow's prepayment is settled (budgets.py)
        self.server_state = self.state_wait_for_response_headers  # the answer stands in for the upstream's
        yield from self._send_answer()

    def _send_answer(self) -> layer.CommandGenerator[None]:
        """The gateway's answer, through the response hooks, then the end of the stream."""
        assert self.flow.response is not None
        self.flow.response.timestamp_start = time.time()
        yield HttpResponseHeadersHook(self.flow)
        if (yield from self.check_killed(True)):
            return
        yield from self.send_response()  # the `response` hook, then the answer to the client
        self._gateway_answered = True
        if self.server_state == self.state_done:  # client_state stays discarding: body events may be queued
            yield from self.flow_done()  # drops the stream: the connection layer discards the rest

    def handle_protocol_error(
        self, event: RequestProtocolError | ResponseProtocolError
    ) -> layer.CommandGenerator[None]:
        """After the gateway's answer, a late error (the aborted upstream closing, the client going away
        while a hook ran) changes nothing: the answer was sent whole; the stream is over."""
        if self._gateway_answered:
            return
        yield from super().handle_protocol_error(event)

    def state_discard_request_body(self, event: events.Event) -> layer.CommandGenerator[None]:
        """Body events queued while the hooks ran: never read into the flow, never forwarded."""
        yield from ()
