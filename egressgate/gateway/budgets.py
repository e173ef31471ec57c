"""Byte budgets, exact to the byte: `resources.outbound_bytes_max` over everything sent upstream.

Counted out: request head (HTTP/1.1 serialization of what goes upstream: after sanitizing and, on a
credentialed route, with the injected credential; see decision.request_head_size),
request body bytes (de-chunked payload), every websocket frame byte from the client as read (headers,
masks, data fragments, ping/pong/close; see ws_layer.py), raw TCP bytes from the client. Counted in:
response bodies, websocket frame bytes and raw TCP bytes from the server.

Credentials are decided before this stage (master.py), so nothing after the prepayment turns the
request into a deny except a failed audit write or what only the body reveals (trailers, a phantom in a
buffered body): those return it through `refund_prepaid`, the one refund.

A request with a known length is paid in full before connecting (429 when it does not fit, so the
upstream never sees a request that could not complete). Chunked / HTTP/2 bodies of unknown length are
streamed through a synchronous callable (mitmproxy's stream hook is synchronous, so the in-process
`ByteLedger` is the authority and writes through to the async state store); the chunk that would cross
the limit is dropped and the whole connection is aborted, so the upstream never sees the terminating
chunk of a cut body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mitmproxy import http, tcp

from egressgate.gateway import ws_layer
from egressgate.gateway.context import FlowState, Runtime, ensure_flow_state, flow_state
from egressgate.gateway.decision import declared_body_size, request_head_size
from egressgate.gateway.deny import gateway_deny
from egressgate.gateway.streaming import STREAM_THRESHOLD, should_stream
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateStore, StateUnavailable

logger = logging.getLogger(__name__)



class ByteLedger:
    """Synchronous per-sandbox counters (authoritative in this process), written through to the store.

    The write-through is coalesced: deltas are summed per sandbox and written once per event-loop tick
    (one `add_bytes` per sandbox), not once per counted chunk — a task per chunk cost ~16 µs, a large
    share of a streamed body's or a splice's CPU (measured, /work/wt/PERF-NOTES.md). The counters here
    stay exact and synchronous; the store only lags by at most one tick more than before."""

    def __init__(self, state: StateStore) -> None:
        self.state = state
        self._out: dict[str, int] = {}
        self._in: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._pending: dict[str, list[int]] = {}  # sandbox -> [out, in] not yet handed to the store
        self._scheduled = False

    async def load(self, sandbox_id: str) -> None:
        if sandbox_id not in self._out:
            snap = await self.state.snapshot(sandbox_id)
            self._out.setdefault(sandbox_id, snap.bytes_out)
            self._in.setdefault(sandbox_id, snap.bytes_in)

    def bytes_out(self, sandbox_id: str) -> int:
        return self._out.get(sandbox_id, 0)

    def bytes_in(self, sandbox_id: str) -> int:
        return self._in.get(sandbox_id, 0)

    def exhausted(self, sandbox_id: str, limit: int | None) -> bool:
        return limit is not None and self._out.get(sandbox_id, 0) >= limit

    def try_out(self, sandbox_id: str, amount: int, limit: int | None) -> bool:
        current = self._out.get(sandbox_id, 0)
        if limit is not None and current + amount > limit:
            return False
        self._out[sandbox_id] = current + amount
        self._write_through(sandbox_id, amount, 0)
        return True

    def refund_out(self, sandbox_id: str, amount: int) -> None:
        if amount:
            self._out[sandbox_id] = self._out.get(sandbox_id, 0) - amount
            self._write_through(sandbox_id, -amount, 0)

    def add_in(self, sandbox_id: str, amount: int) -> None:
        if amount:
            self._in[sandbox_id] = self._in.get(sandbox_id, 0) + amount
            self._write_through(sandbox_id, 0, amount)

    def _write_through(self, sandbox_id: str, out: int, in_: int) -> None:
        pending = self._pending.get(sandbox_id)
        if pending is None:
            self._pending[sandbox_id] = [out, in_]
        else:
            pending[0] += out
            pending[1] += in_
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Hand the summed deltas to the store: one tracked task per sandbox."""
        self._scheduled = False
        pending, self._pending = self._pending, {}
        loop = asyncio.get_running_loop()
        for sandbox_id, (out, in_) in pending.items():
            if out or in_:
                task = loop.create_task(self.state.add_bytes(sandbox_id, out=out, in_=in_))
                self._tasks.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("state write-through failed: %s", task.exception())

    async def flush(self) -> None:
        if self._pending:
            self._drain()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def refund_prepaid(rt: Runtime, fs: FlowState) -> None:
    """A prepaid request that a later check refused before anything of it went upstream: return the
    bytes to the sandbox's budget (the only place a refund happens)."""
    if fs.prepaid_out and fs.sandbox_id:
        rt.ledger.refund_out(fs.sandbox_id, fs.prepaid_out)
        fs.bytes_out -= fs.prepaid_out
        fs.prepaid_out = 0


def outbound_limit(rt: Runtime, fs: FlowState) -> int | None:
    policy = rt.policies.get(fs.policy_name)
    return policy.outbound_bytes_max if policy is not None else None


def out_counter(rt: Runtime, fs: FlowState, client_id: str, limit: int | None) -> Callable[[bytes], object]:
    """Stream callable for request bodies: count, and cut + abort on the chunk that would cross."""
    sandbox_id = fs.sandbox_id
    assert sandbox_id is not None
    state = {"cut": False}

    def count(chunk: bytes) -> object:
        if state["cut"]:
            return []  # never b"": an empty chunk is the chunked terminator on HTTP/1
        if not chunk:
            return []
        if rt.ledger.try_out(sandbox_id, len(chunk), limit):
            fs.bytes_out += len(chunk)
            return chunk
        state["cut"] = True
        fs.budget_cut = True
        logger.info("sandbox %s crossed outbound_bytes_max mid-stream; cutting", sandbox_id)
        if rt.abort_connection is not None:
            rt.abort_connection(client_id)
        return []

    return count


def in_counter(rt: Runtime, fs: FlowState) -> Callable[[bytes], object]:
    sandbox_id = fs.sandbox_id
    assert sandbox_id is not None

    def count(chunk: bytes) -> object:
        if chunk:
            fs.bytes_in += len(chunk)
            rt.ledger.add_in(sandbox_id, len(chunk))
        return chunk

    return count


class Budgets:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def _limit(self, fs: FlowState) -> int | None:
        return outbound_limit(self.rt, fs)

    async def _load(self, fs: FlowState) -> bool:
        try:
            assert fs.sandbox_id is not None
            await self.rt.ledger.load(fs.sandbox_id)
            return True
        except (StateUnavailable, KeyError):
            fs.decision = gateway_deny(Reason.STATE_UNAVAILABLE)
            return False

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        fs = ensure_flow_state(flow)
        if fs.decision is None or not fs.decision.allowed:
            return
        if await self._load(fs) and self.rt.ledger.exhausted(fs.sandbox_id, self._limit(fs)):
            fs.decision = gateway_deny(Reason.BUDGET_EXCEEDED, detail="outbound_bytes_max")

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs = ensure_flow_state(flow)
        if fs.decision is None or not fs.decision.allowed or flow.response is not None:
            return
        if not await self._load(fs):
            return
        limit = self._limit(fs)
        head = request_head_size(flow.request)
        body = declared_body_size(flow.request)
        prepay = head + (body or 0)
        assert fs.sandbox_id is not None
        if not self.rt.ledger.try_out(fs.sandbox_id, prepay, limit):
            remaining = max(0, (limit or 0) - self.rt.ledger.bytes_out(fs.sandbox_id))
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

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """Plan the response body: streamed (counted by its callable) or buffered (counted in `response`)."""
        fs = flow_state(flow)
        if fs is not None and flow.response is not None and fs.decision is not None and fs.decision.allowed:
            fs.stream_response = should_stream(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if (fs is None or fs.sandbox_id is None or flow.response is None or fs.stream_response
                or fs.replacement is not None):
            return  # a streamed body is counted by its callable; a replaced one never reaches the sandbox
        if fs.decision is not None and fs.decision.allowed and flow.response.raw_content:
            n = len(flow.response.raw_content)
            fs.bytes_in += n
            self.rt.ledger.add_in(fs.sandbox_id, n)

    def websocket_wire(self, chunk: ws_layer.WireChunk) -> None:
        """Every byte of every websocket frame, counted as it is read and before it is parsed (frame
        headers, masks, data fragments — a message without FIN included — pings, pongs and closes).
        A read from the sandbox that would cross the budget is refused unparsed: nothing of it is
        relayed and the websocket is closed (1008 budget_exceeded)."""
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
        if not self.rt.ledger.try_out(fs.sandbox_id, n, self._limit(fs)):
            fs.budget_cut = True
            logger.info("sandbox %s crossed outbound_bytes_max on a websocket; closing it", fs.sandbox_id)
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

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
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
        policy = self.rt.policies.get(conn.policy_name)
        limit = policy.outbound_bytes_max if policy is not None else 0
        if message.from_client:
            if not self.rt.ledger.try_out(conn.sandbox_id, n, limit):
                message.content = b""
                fs.budget_cut = True
                if self.rt.abort_connection is not None:
                    self.rt.abort_connection(flow.client_conn.id)
                return
            fs.bytes_out += n
        else:
            fs.bytes_in += n
            self.rt.ledger.add_in(conn.sandbox_id, n)
