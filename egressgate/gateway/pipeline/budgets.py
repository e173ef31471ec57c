"""Byte budgets, exact to the byte: `resources.outbound_bytes_max` over everything sent upstream, held
by the state store and shared by every gateway process on it (ledger.py: the accounting).

Counted out: request head (HTTP/1.1 serialization of what goes upstream: after sanitizing and, on a
credentialed route, with the injected credential; see sizes.request_head_size),
request body bytes (de-chunked payload), every websocket frame byte from the client as read (headers,
masks, data fragments, ping/pong/close; see ws_layer.py), raw TCP bytes from the client. Counted in:
response bodies, websocket frame bytes and raw TCP bytes from the server.

Credentials are decided before this stage (master.py), so nothing after the prepayment turns the
request into a deny except a failed audit write or what only the body reveals (trailers, a phantom in a
buffered body): those return it through `refund_prepaid`, the one refund. The prepayment is committed
(spent) at the `request` hook, which runs after every stage that can refund it, or when the flow ends.

A request with a known length reserves exactly its size before connecting (429 with the remaining figure
when it does not fit, so the upstream never sees a request that could not complete), in the same atomic
store step that checks and counts its rule's budget and enters it into the sandbox's history
(`StateStore.reserve_request`: one Redis round trip after the decision's snapshot; enforce.py then has
nothing left to write). Bytes of unknown
total (chunked / HTTP/2 bodies, websocket frames, raw TCP) are paid from a per-flow `Meter` over the
sandbox's leased pool: the synchronous stream callable and hooks spend from it; when it runs dry the
flow pauses (http_layer.py yields a blocking `BudgetTopUpHook` before the chunk reaches the callable;
`websocket_wire` and `tcp_message` await the top-up) and resumes when the store granted more. Only when
the store says the budget cannot hold the chunk is it dropped and the whole connection aborted, so the
upstream never sees the terminating chunk of a cut body.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from mitmproxy import http, tcp

from egressgate.gateway.layers import ws_layer
from egressgate.gateway.shared.context import FlowState, Runtime, ensure_flow_state, flow_state
from egressgate.gateway.shared.counters import finish_flow, hold_client, rule_budget
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.ledger import ByteLedger as ByteLedger  # re-exported: app.py builds it from here
from egressgate.gateway.shared.ledger import Meter, TopUp, answer_top_up
from egressgate.gateway.shared.sizes import declared_body_size, request_head_size
from egressgate.gateway.shared.streaming import STREAM_THRESHOLD, should_stream
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)


def flow_meter(rt: Runtime, fs: FlowState, sandbox_id: str, limit: int | None) -> Meter:
    """The flow's open meter (a websocket or a raw-TCP relay opens one at its first counted bytes)."""
    meter = fs.meter
    if meter is None or meter.closed:
        meter = fs.meter = rt.ledger.open(sandbox_id, limit)
    return meter


async def top_up_paused(top: TopUp) -> None:
    """`answer_top_up` with the sandbox's connection not read meanwhile (hold_client)."""
    resume = hold_client(top.flow.client_conn.id)
    try:
        await answer_top_up(top)
    finally:
        resume()


def outbound_limit(rt: Runtime, fs: FlowState) -> int | None:
    policy = rt.policies.get(fs.policy_name)
    return policy.outbound_bytes_max if policy is not None else None


class Budgets:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def _limit(self, fs: FlowState) -> int | None:
        return outbound_limit(self.rt, fs)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs = ensure_flow_state(flow)
        if fs.decision is None or not fs.decision.allowed or flow.response is not None:
            return
        sandbox_id = fs.sandbox_id
        assert sandbox_id is not None
        limit = self._limit(fs)
        head = request_head_size(flow.request)
        body = declared_body_size(flow.request)
        prepay = head + (body or 0)
        if fs.host is not None:
            fits, remaining = await self._reserve_and_record(fs, sandbox_id, prepay, limit)
            if fits is None:
                return
        else:  # no host to enter into the history (enforce.py refuses it): the bytes alone
            try:
                fits = await self.rt.ledger.reserve(sandbox_id, prepay, limit)
                remaining = 0 if fits else await self.rt.ledger.remaining(sandbox_id, limit)
            except (StateUnavailable, KeyError) as exc:
                logger.error("byte budget of %s unavailable: %s", sandbox_id, exc)
                fs.decision = gateway_deny(Reason.STATE_UNAVAILABLE, detail="outbound_bytes_max")
                return
        if not fits:
            fs.budget_refused = fs.budget_refused or (prepay, max(0, (limit or 0) - remaining))
            fs.decision = gateway_deny(
                Reason.BUDGET_EXCEEDED,
                f"This request needs {prepay} bytes but only {remaining} bytes of the sandbox's outbound "
                f"budget remain.",
                detail="outbound_bytes_max",
            )
            return
        fs.prepaid_out = prepay
        fs.bytes_out = prepay
        # the plan; compose.py builds the callable once the decision is recorded (enforce.py)
        fs.meter_request = body is None  # unknown length: counted (and cut) chunk by chunk
        fs.stream_request = body is None or body > STREAM_THRESHOLD  # a large known one is paid in full
        if body is None:
            fs.meter = self.rt.ledger.open(sandbox_id, limit)

    async def _reserve_and_record(self, fs: FlowState, sandbox_id: str, prepay: int,
                                  limit: int | None) -> tuple[bool | None, int]:
        """The prepayment, the rule's budget (`budget.requests` / `budget.bytes`) and the request's entry in
        the sandbox's history in one atomic store step (one round trip on Redis; enforce.py then has
        nothing left to write). (True, 0): reserved and recorded; (False, remaining bytes): the byte budget
        cannot hold it; (None, 0): refused here, `fs.decision` says why.

        decide() judged the rule's budget on a snapshot that concurrent requests (on any gateway process)
        may have shared: the store's check-and-count is the authority, and a request over it is refused
        `budget_exceeded` (detail `rule_budget`) as its decision, before its record is written. Fail
        closed: when the store cannot write the history, the request is refused `state_unavailable` (a
        request the history does not know of would escape every later `after_request_to` /
        `unless_request_to` condition and request budget). A request refused after this step (its
        decision record could not be written, its body) stays in the history and its rule's usage, as it
        did when the history was written after the record: counts may over-state, never under-state."""
        allowed = fs.decision
        assert allowed is not None and fs.host is not None
        budget = rule_budget(self.rt, fs)
        try:
            grant = await self.rt.ledger.reserve_request(
                sandbox_id, prepay, limit, fs.host, allowed.rule_id,
                requests_max=budget.requests if budget is not None else None,
                bytes_max=budget.bytes if budget is not None else None)
        except (StateUnavailable, KeyError) as exc:
            logger.error("could not reserve and record the request of %s: %s; refusing it", sandbox_id, exc)
            fs.decision = replace(gateway_deny(Reason.STATE_UNAVAILABLE, detail="request history not written",
                                               rule_id=allowed.rule_id), capability=allowed.capability)
            return None, 0
        if grant.refused == "rule":
            fs.decision = replace(gateway_deny(
                Reason.BUDGET_EXCEEDED, f"The budget of rule {allowed.rule_id!r} is spent (its budget.requests "
                "or budget.bytes); further requests under it are refused.", detail="rule_budget",
                rule_id=allowed.rule_id), capability=allowed.capability)
            return None, 0
        if grant.refused is not None:
            # the record carries what the store's check read (spent and leased, this process's idle pool
            # included): audit replay re-applies exactly that; the 429's figure below adds back the idle pool
            fs.budget_refused = (prepay, grant.bytes_out)
            pool_avail = self.rt.ledger.held(sandbox_id)
            return False, max(0, (limit or 0) - grant.bytes_out + pool_avail)
        fs.history_written = True
        return True, 0

    async def budget_top_up(self, top: TopUp) -> None:
        """A layer paused a flow until its meter holds the next chunk (ledger.BudgetTopUpHook)."""
        await top_up_paused(top)

    def request(self, flow: http.HTTPFlow) -> None:
        """After Trailers and Credentials (the last refunds): the prepayment is spent."""
        fs = flow_state(flow)
        if fs is not None:
            finish_flow(self.rt, fs)

    def error(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is not None:
            finish_flow(self.rt, fs)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """Plan the response body: streamed (counted by its callable) or buffered (counted in `response`)."""
        fs = flow_state(flow)
        if fs is not None and flow.response is not None and fs.decision is not None and fs.decision.allowed:
            fs.stream_response = should_stream(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is None:
            return
        if flow.websocket is None and flow.request.timestamp_end is not None:
            finish_flow(self.rt, fs)  # an early answer while the body still streams: `request` does it
        if (fs.sandbox_id is None or flow.response is None or fs.stream_response
                or fs.replacement is not None):
            return  # a streamed body is counted by its callable; a replaced one never reaches the sandbox
        if fs.decision is not None and fs.decision.allowed and flow.response.raw_content:
            n = len(flow.response.raw_content)
            fs.bytes_in += n
            self.rt.ledger.add_in(fs.sandbox_id, n)

    async def websocket_wire(self, chunk: ws_layer.WireChunk) -> None:
        """Every byte of every websocket frame, counted as it is read and before it is parsed (frame
        headers, masks, data fragments — a message without FIN included — pings, pongs and closes).
        The layer waits for this hook: a read the flow's lease cannot cover waits for a top-up; a read
        that would cross the budget is refused unparsed: nothing of it is relayed and the websocket is
        closed (1008 budget_exceeded)."""
        flow = chunk.flow
        fs = flow_state(flow)
        if fs is None or fs.sandbox_id is None:
            ws_layer.refuse(flow, Reason.INTERNAL_ERROR, ws_layer.INTERNAL_ERROR,
                            "The gateway lost track of this websocket; it was closed.")
            return
        n = chunk.size
        if not chunk.from_client:
            fs.bytes_in += n
            fs.ws_in += n
            self.rt.ledger.add_in(fs.sandbox_id, n)
            return
        meter = flow_meter(self.rt, fs, fs.sandbox_id, self._limit(fs))
        if not meter.take(n):
            top = TopUp(flow, meter, n)
            await top_up_paused(top)
            if not (top.ok and meter.take(n)):
                logger.info("sandbox %s: %s on a websocket; closing it", fs.sandbox_id,
                            top.error or "outbound_bytes_max crossed")
                if top.error is not None:  # fail closed: the store could not say
                    fs.state_cut = True
                    ws_layer.refuse(flow, Reason.STATE_UNAVAILABLE, ws_layer.INTERNAL_ERROR,
                                    "The gateway could not read the sandbox's byte budget.",
                                    detail="outbound_bytes_max")
                else:
                    fs.budget_cut = True
                    ws_layer.refuse(flow, Reason.BUDGET_EXCEEDED, ws_layer.POLICY_VIOLATION,
                                    "The sandbox's outbound byte budget is exhausted.", detail="outbound_bytes_max")
                return
        fs.bytes_out += n
        fs.ws_out += n

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Messages were paid for as their frames arrived (websocket_wire); only keep memory bounded."""
        assert flow.websocket is not None
        # mitmproxy keeps every message of a flow; a long-lived socket would grow without bound. Only
        # the current one is needed (later addons read messages[-1]); totals live in the FlowState.
        del flow.websocket.messages[:-1]

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is not None:
            finish_flow(self.rt, fs)

    async def tcp_message(self, flow: tcp.TCPFlow) -> None:
        """Raw TCP (a `network.tcp` rule): the relay waits for this hook, so a message the lease cannot
        cover waits for a top-up; one the budget cannot hold is dropped and the connection cut."""
        conn = self.rt.conns.get(flow.client_conn.id)
        message = flow.messages[-1]
        del flow.messages[:-1]  # bounded memory for long relays; totals are kept in the FlowState
        fs = ensure_flow_state(flow)
        if conn is None or conn.sandbox_id is None or conn.tcp_allowed_rule is None:
            message.content = b""
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(flow.client_conn.id)
            return
        n = len(message.content)
        if not message.from_client:
            fs.bytes_in += n
            self.rt.ledger.add_in(conn.sandbox_id, n)
            return
        policy = self.rt.policies.get(conn.policy_name)
        meter = flow_meter(self.rt, fs, conn.sandbox_id, policy.outbound_bytes_max if policy is not None else 0)
        if not meter.take(n):
            top = TopUp(flow, meter, n)
            await top_up_paused(top)
            if not (top.ok and meter.take(n)):
                message.content = b""
                if top.error is not None:  # the store failed: the outcome says state_unavailable
                    fs.state_cut = True
                else:
                    fs.budget_cut = True
                if self.rt.abort_connection is not None:
                    self.rt.abort_connection(flow.client_conn.id)
                return
        fs.bytes_out += n

    def tcp_end(self, flow: tcp.TCPFlow) -> None:
        fs = flow_state(flow)
        if fs is not None and fs.meter is not None:
            fs.meter.close()

    tcp_error = tcp_end
