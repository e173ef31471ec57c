"""The HTTP layer every gateway connection runs: mitmproxy's HttpLayer with the gateway's HTTP/1 framing
(http1_framing.py) and one fix to how a streamed request ends.

Installed by the next-layer addon (layers/next_layer.py) for the explicit-proxy listener and inside every tunnel, so
no HTTP flow runs on mitmproxy's stock layers:

* the client connection speaks HTTP/1 through `GatewayHttp1Server` (HTTP/2: `GatewayHttp2Server`,
  h2_limits.py; preset before mitmproxy's Start
  handler, which keeps a preset connection: its `setdefault` exists for client replay);
* every new upstream connection stack gets `GatewayHttpClient`, which opens HTTP/1 upstreams with
  `GatewayHttp1Client` (HTTP/2: `GatewayHttp2Client`) (swapped in before the stack starts: mitmproxy builds the stack in
  `get_connection` and offers no factory for it);
* streams are `GatewayHttpStream` (a CONNECT tunnel's relay keeps half-closes: tunnel_close.py; a request
  refused at its headers is answered before its body is read: early_answer.py).

`GatewayHttpStream`: for a *streamed* request body, mitmproxy runs the `request` hook after the body went
upstream and then sends the trailers and the end of the request whatever the hook did — a deny response
or a kill set there was ignored, and the upstream saw a complete request. Here, when an addon answered
(`flow.response`) or killed the flow in that hook, or trailers are still attached (the gateway never
forwards request trailers; trailers.py refuses them), the upstream request is aborted instead (HTTP/1:
connection closed before the terminating chunk; HTTP/2: stream reset), so it never completes, and the
client gets the answer (or, for a kill, a reset). A buffered request that still carries trailers when it
is about to be forwarded is killed as well: no request trailer ever leaves the gateway.

`GatewayHttpStream` also pauses a metered request body (unknown length) whose next chunk the flow's byte
lease cannot cover: it yields a blocking `BudgetTopUpHook` (ledger.py) and resumes once the Budgets addon
has topped the lease up from the state store (the events that arrive meanwhile are queued by mitmproxy's
Layer, none is dropped). Budgets are shared by every gateway process, so a lease that runs dry is normal,
not exhaustion; the stream is cut only when the store refuses.

The overridden methods copy mitmproxy 12.3.1's bodies (marked where they do); re-check them, and
http1_framing.py, on any mitmproxy upgrade (tests/gateway_credentials/test_trailers.py exercises each path).
"""

from __future__ import annotations

import time

from mitmproxy import flow
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import (
    HttpClient,
    HttpLayer,
    HTTPMode,
    RegisterHttpConnection,
    SendHttp,
    is_h3_alpn,
)
from mitmproxy.proxy.layers.http._events import (
    ErrorCode,
    RequestData,
    RequestEndOfMessage,
    RequestProtocolError,
    RequestTrailers,
    ResponseData,
    ResponseEndOfMessage,
    ResponseHeaders,
    ResponseProtocolError,
)
from mitmproxy.proxy.layers.http._hooks import (
    HttpRequestHeadersHook,
    HttpRequestHook,
    HttpResponseHeadersHook,
    HttpResponseHook,
)
from mitmproxy.proxy.layers.http._http3 import Http3Client
from mitmproxy.proxy.utils import expect

from egressgate.gateway.layers.early_answer import EarlyAnswerStream
from egressgate.gateway.layers.h2_limits import GatewayHttp2Client, GatewayHttp2Server
from egressgate.gateway.layers.http1_framing import (
    DEFAULT_RESPONSE_HEAD_MAX,
    GatewayHttp1Client,
    GatewayHttp1Server,
    Refusal,
    RefusedRequest,
)
from egressgate.gateway.shared.context import flow_state
from egressgate.gateway.shared.deny import deny_response, gateway_deny
from egressgate.gateway.shared.ledger import BudgetTopUpHook, TopUp
from egressgate.policy.reasons import Reason


def fork(ctx: Context) -> Context:
    """`ctx.fork()` without building a throw-away `Server`: mitmproxy's fork calls `Context.__init__`,
    which constructs a fresh Server (a dataclass with a checking `__setattr__`) only to replace it with
    the parent's. Once per request (every stream): ~3 % of the gateway's CPU on plain HTTP (issue 11).
    Same four attributes as mitmproxy 12.3.1's Context.__init__ + fork (tests/gateway/test_http_layer_fork.py
    compares them)."""
    ret = Context.__new__(Context)
    ret.client = ctx.client
    ret.options = ctx.options
    ret.server = ctx.server
    ret.layers = ctx.layers.copy()
    return ret


class GatewayHttpClient(HttpClient):
    """mitmproxy's HttpClient, opening HTTP/1 upstreams with GatewayHttp1Client."""

    def __init__(self, context, max_response_head: int = DEFAULT_RESPONSE_HEAD_MAX) -> None:
        super().__init__(context)
        self.max_response_head = max_response_head

    @expect(events.Start)
    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        err: str | None = None
        if not self.context.server.connected:
            err = yield commands.OpenConnection(self.context.server)
        if not err:
            if is_h3_alpn(self.context.server.alpn):
                self.child_layer = Http3Client(self.context)
            elif self.context.server.alpn == b"h2":
                self.child_layer = GatewayHttp2Client(self.context)
            else:
                self.child_layer = GatewayHttp1Client(self.context, self.max_response_head)
            self._handle_event = self.child_layer.handle_event
            yield from self._handle_event(event)
        yield RegisterHttpConnection(self.context.server, err)


class GatewayHttpStream(EarlyAnswerStream):
    def handle_protocol_error(
            self, event: RequestProtocolError | ResponseProtocolError) -> layer.CommandGenerator[None]:
        """A request or response the HTTP/1 framing refused (http1_framing.py: an unbounded line): the
        outcome record keeps why, and the client's refusal carries this flow's request id. mitmproxy
        sends nothing to the client for a request error, so the answer to a refused request is sent here."""
        if not isinstance(event, (Refusal, RefusedRequest)):
            yield from super().handle_protocol_error(event)
            return
        fs = flow_state(self.flow)
        request_id = fs.request_id if fs is not None else "-"
        if fs is not None:
            if isinstance(event, RefusedRequest):
                fs.request_refused = event.reason
            else:
                fs.response_refused = event.reason
        if isinstance(event, Refusal):
            event.request_id = request_id
        yield from super().handle_protocol_error(event)
        if isinstance(event, RefusedRequest):
            answer = Refusal(self.stream_id, event.message, event.reason, status=400)
            answer.request_id = request_id
            yield SendHttp(answer, self.context.client)

    def handle_connect_finish(self) -> layer.CommandGenerator[None]:
        """Once the CONNECT is answered, the tunnel's layer is chosen right away, not at the client's
        first bytes (mitmproxy's NextLayer asks only on data). A relayed tunnel (`tls: passthrough`, a
        `network.tcp` rule) writes its one outcome record from its layer: without a layer, an allowed and
        dialed tunnel that the client closed, reset or that revocation cut before any byte had no
        outcome record. Asked after the answer went out, so a refusing layer's bytes follow it; an
        intercepted tunnel still waits for bytes (layers/next_layer.py needs them to tell TLS from HTTP)."""
        yield from super().handle_connect_finish()
        child = self.child_layer
        response = self.flow.response
        if (type(child) is layer.NextLayer and child.layer is None and response is not None
                and 200 <= response.status_code < 300):
            yield from child._ask()  # mitmproxy's "manually trigger a next_layer hook"

    def check_invalid(self, request: bool) -> layer.CommandGenerator[bool]:
        """On the transparent listener mitmproxy refuses a CONNECT with a 400 HTML page of its own (no
        hook sees it as a request). There the addons refuse it (transparent.py: a CONNECT is not a
        way in, whatever Proxy-Authorization it carries), and the refusal is audited and answered with
        the deny contract like any other: decision record, deny body, outcome record, then the end."""
        if not (request and self.mode is HTTPMode.transparent and self.flow.request.method.upper() == "CONNECT"):
            return (yield from super().check_invalid(request))
        yield HttpRequestHeadersHook(self.flow)
        if self.flow.response is None:  # fail closed: nothing may answer a CONNECT here but a deny
            fs = flow_state(self.flow)
            self.flow.response = deny_response(gateway_deny(Reason.PROTOCOL_NOT_ALLOWED),
                                               fs.request_id if fs is not None else "-")
        yield HttpResponseHook(self.flow)
        response = self.flow.response
        yield SendHttp(ResponseHeaders(self.stream_id, response, not response.raw_content), self.context.client)
        if response.raw_content:
            yield SendHttp(ResponseData(self.stream_id, response.raw_content), self.context.client)
        yield SendHttp(ResponseEndOfMessage(self.stream_id), self.context.client)
        self.flow.live = False
        self.client_state = self.server_state = self.state_errored
        return True

    def check_killed(self, emit_error_hook: bool) -> layer.CommandGenerator[bool]:
        """mitmproxy takes any request error queued while a hook ran for the client having gone away
        (the flow is killed, the client gets no answer); a refused request is answered instead."""
        refused = next((e for e in self._paused_event_queue if isinstance(e, RefusedRequest)), None)
        killed_by_us = self.flow.error is not None and self.flow.error.msg == flow.Error.KILLED_MESSAGE
        if refused is None or killed_by_us:
            return (yield from super().check_killed(emit_error_hook))
        self._paused_event_queue.remove(refused)
        yield from self.handle_protocol_error(refused)
        # answered and over: body events still queued behind the refusal are dropped (before, the next one
        # reached the state that had been waiting for the headers: "mitmproxy has crashed!")
        self.client_state = self.server_state = self.state_errored
        return True

    @expect(RequestData, RequestTrailers, RequestEndOfMessage)
    def state_stream_request_body(self, event: events.Event) -> layer.CommandGenerator[None]:
        if not isinstance(event, RequestEndOfMessage):
            if isinstance(event, RequestData) and not (yield from self._budget_covers(len(event.data))):
                return
            yield from super().state_stream_request_body(event)
            fs = flow_state(self.flow)
            # the budget counter dropped the crossing chunk, or the phantom guard found a placeholder
            # credential (the decision turned to deny): early_answer.py aborts the upstream, answers
            if fs is not None and (fs.budget_cut or fs.state_cut or (fs.decision is not None
                                                                     and not fs.decision.allowed)):
                yield from self.cut_mid_body()
            return
        # mitmproxy 12.3.1's end-of-message branch, with the request hook's verdict enforced
        if callable(self.flow.request.stream):
            chunks = self.flow.request.stream(b"")
            if chunks == b"":
                chunks = []
            elif isinstance(chunks, bytes):
                chunks = [chunks]
            for chunk in chunks:
                if self.context.options.store_streamed_bodies:
                    self.request_body_buf += chunk
                yield SendHttp(RequestData(self.stream_id, chunk), self.context.server)
        if self.context.options.store_streamed_bodies:
            self.flow.request.data.content = bytes(self.request_body_buf)
            self.request_body_buf.clear()
        self.flow.request.timestamp_end = time.time()
        upstream_response = self.flow.response  # an upstream may answer before the request is complete
        yield HttpRequestHook(self.flow)
        self.client_state = self.state_done
        if (yield from self._refused_after_stream(upstream_response)):
            return
        yield SendHttp(event, self.context.server)
        if self.server_state == self.state_done:
            yield from self.flow_done()

    def _budget_covers(self, size: int) -> layer.CommandGenerator[bool]:
        """A metered body chunk (unknown length, budgets.py) is covered by the flow's lease before it
        reaches the stream callable. When the lease cannot cover it, the stream pauses on a blocking
        hook while the Budgets addon tops the lease up from the state store: mitmproxy queues this
        stream's events meanwhile (Layer._paused), so nothing is dropped and nothing is cut while budget
        remains. False: the flow was killed meanwhile (it is not continued). When the store refused, the
        chunk still goes to the callable, whose counter cuts the connection (budget exhausted)."""
        fs = flow_state(self.flow)
        meter = fs.meter if fs is not None else None
        if meter is None or meter.cover(size):
            return True
        yield BudgetTopUpHook(TopUp(self.flow, meter, size))
        return not (yield from self.check_killed(True))

    def make_server_connection(self) -> layer.CommandGenerator[bool]:
        """For a buffered request this runs after the `request` hook: request trailers still attached
        here were refused by nobody (trailers.py answers them), so the request is killed, not forwarded
        (defense in depth; a streamed request connects at its headers, before any trailer exists)."""
        if self.flow.request.trailers:
            self.flow.kill()
            yield from self.check_killed(True)
            return False
        return (yield from super().make_server_connection())

    def _refused_after_stream(self, upstream_response) -> layer.CommandGenerator[bool]:
        killed = self.flow.error is not None and self.flow.error.msg == flow.Error.KILLED_MESSAGE
        answered = self.flow.response is not None and self.flow.response is not upstream_response
        if not (killed or answered or self.flow.request.trailers):
            return False
        # the upstream has (part of) the body but not its end: abort it so the request never completes
        yield SendHttp(RequestProtocolError(self.stream_id, "refused by the gateway", ErrorCode.KILL),
                       self.context.server)
        if killed or not answered or upstream_response is not None:
            # a kill, trailers nobody refused (defense in depth), or an answer while the upstream's own
            # response is already on its way to the client: nothing clean can be sent, reset instead
            if not killed:
                self.flow.kill()
            yield from self.check_killed(True)
            return True
        self.server_state = self.state_wait_for_response_headers  # the answer stands in for the upstream's
        self.flow.response.timestamp_start = time.time()
        yield HttpResponseHeadersHook(self.flow)
        if (yield from self.check_killed(True)):
            return True
        yield from self.send_response()
        return True


class GatewayHttpLayer(HttpLayer):
    """The overrides below are plain functions returning mitmproxy's generator, not generators themselves:
    `event_to_child` runs for every event and every command at every level of the layer tree, and a
    `yield from` wrapper there added a generator frame to each of them (measured: ~5 % of the CPU per
    request). The callers drive the returned generator at once, so the work done before returning
    happens at the same point it did inside a wrapper generator."""

    max_response_head = DEFAULT_RESPONSE_HEAD_MAX  # bytes of an upstream's HTTP/1 response head

    def _handle_event(self, event: events.Event):
        if isinstance(event, events.Start):
            alpn = self.context.client.alpn
            if alpn == b"h2":
                self.connections.setdefault(self.context.client, GatewayHttp2Server(self.context.fork()))
            elif not is_h3_alpn(alpn):  # as HttpLayer picks; it keeps a preset connection
                self.connections.setdefault(self.context.client, self._client_http1_server())
        elif (isinstance(event, events.DataReceived) and event.connection is self.context.server
              and self.context.server not in self.connections and not is_h3_alpn(self.context.server.alpn)):
            # An upstream that speaks before any request was sent on it (every HTTP/2 server sends its
            # SETTINGS at once; a hostile HTTP/1 upstream may send a head unasked): mitmproxy would build
            # a stock Http1Client/Http2Client for it, skipping the gateway's framing bounds (response
            # heads, chunk lines, 1xx, HTTP/2 header blocks). The gateway's client layers take it instead.
            return self._upstream_spoke_first(event)
        return super()._handle_event(event)

    def _client_http1_server(self) -> GatewayHttp1Server:
        """The HTTP/1 layer for the client connection (http_limits.py adds the head-size bound)."""
        return GatewayHttp1Server(self.context.fork())

    def _upstream_spoke_first(self, event: events.DataReceived) -> layer.CommandGenerator[None]:
        """mitmproxy 12.3.1's HttpLayer._handle_event branch for data on a server connection nobody
        used yet, with the gateway's client layers."""
        ctx = self.context.fork()
        child = (GatewayHttp2Client(ctx) if self.context.server.alpn == b"h2"
                 else GatewayHttp1Client(ctx, self.max_response_head))
        self.connections[self.context.server] = child
        yield from self.event_to_child(child, events.Start())
        yield from self.event_to_child(child, event)

    def make_stream(self, stream_id: int) -> layer.CommandGenerator[None]:
        self.streams[stream_id] = GatewayHttpStream(fork(self.context), stream_id)
        yield from self.event_to_child(self.streams[stream_id], events.Start())

    def event_to_child(self, child, event: events.Event):
        if isinstance(event, events.Start):
            child = self._with_gateway_client(child)
        return super().event_to_child(child, event)

    def _with_gateway_client(self, top: layer.Layer) -> layer.Layer:
        """Replace mitmproxy's HttpClient at the bottom of a new upstream stack (before it starts)."""
        parent, current = None, top
        while current is not None and type(current) is not HttpClient:
            parent, current = current, getattr(current, "child_layer", None)
        if current is None:
            return top
        ctx = current.context
        ctx.layers.remove(current)  # Layer.__init__ registered it; the replacement registers itself
        replacement = GatewayHttpClient(ctx, self.max_response_head)
        if parent is not None:
            parent.child_layer = replacement
            return top
        for conn, handler in list(self.connections.items()):
            if handler is current:
                self.connections[conn] = replacement
        return replacement
