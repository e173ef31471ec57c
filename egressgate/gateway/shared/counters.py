"""Refunds and byte counters: what several stages do with a flow's bytes (budgets.py plans and reserves).

- `refund_prepaid`: the one refund of a prepayment, for a request a later stage refused before anything
  of it went upstream (Credentials, Trailers, Record on a failed audit write, Enforce's rule budget, the
  MCP route); `finish_flow`: the prepayment stays spent once it can no longer be refunded.
- `out_counter` / `in_counter`: the budget counters compose.py chains into a body's stream callable.
- `rule_budget`: the budget of the rule that allowed a flow (the store's atomic check-and-count).
- `hold_client`: a flow waiting for a lease top-up stops reading its client connection (Budgets' hooks,
  early_answer.py's streamed bodies).
Shared, so no stage imports budgets.py (tests/architecture/test_stage_imports.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mitmproxy import ctx

from egressgate.gateway.shared.context import FlowState, Runtime
from egressgate.policy.model import Budget

logger = logging.getLogger(__name__)


def refund_prepaid(rt: Runtime, fs: FlowState) -> None:
    """A prepaid request that a later check refused before anything of it went upstream: return the
    bytes to the sandbox's budget (the only place a refund happens). Its meter, if any, is closed."""
    if fs.prepaid_out and fs.sandbox_id and not fs.prepay_committed:
        rt.ledger.give_back(fs.sandbox_id, fs.prepaid_out)
        fs.bytes_out -= fs.prepaid_out
        fs.prepaid_out = 0
    if fs.meter is not None:
        fs.meter.close()


def finish_flow(rt: Runtime, fs: FlowState) -> None:
    """The request can no longer be refunded (it went, or may have gone, upstream): its prepayment stays
    spent; its meter's unused credit goes back. Idempotent."""
    if fs.prepaid_out and fs.sandbox_id and not fs.prepay_committed:
        fs.prepay_committed = True
        rt.ledger.commit(fs.sandbox_id, fs.prepaid_out)
    if fs.meter is not None:
        fs.meter.close()


def hold_client(client_id: str) -> Callable[[], None]:
    """Stop reading from a sandbox's connection while one of its flows waits for a lease top-up; returns
    the function that reads again. mitmproxy keeps reading a connection whose layer is paused and queues
    what it reads in memory, so during a slow store round trip (up to its 2 s timeout) a sandbox could
    make the gateway buffer whatever it can send; held, the kernel's socket buffers push back instead.
    (A connection multiplexing HTTP/2 streams is held for all of them, for one round trip.)"""
    proxyserver = ctx.master.addons.get("proxyserver") if ctx.master is not None else None
    handler = proxyserver.connections.get(client_id) if proxyserver is not None else None
    io = handler.transports.get(handler.client) if handler is not None else None
    transport = getattr(getattr(io, "writer", None), "transport", None)
    if transport is None or transport.is_closing():
        return _nothing
    transport.pause_reading()
    # mitmproxy's StreamReader pauses the transport itself when its buffer is full and resumes it once
    # mitmproxy has read the buffer; taken over here (no public API), so that resume does not undo the
    # hold. After the hold its own flow control applies again from the next read.
    reader = getattr(io, "reader", None)
    if isinstance(reader, asyncio.StreamReader):
        reader._paused = False

    def resume() -> None:
        if not transport.is_closing() and not transport.is_reading():
            transport.resume_reading()

    return resume


def _nothing() -> None:
    return None


def rule_budget(rt: Runtime, fs: FlowState) -> Budget | None:
    """The budget of the rule that allowed this flow (None: it has none), for the store's atomic
    check-and-count (enforce.py)."""
    rule_id = fs.decision.rule_id if fs.decision is not None else None
    policy = rt.policies.get(fs.policy_name)
    if rule_id is None or policy is None or rule_id not in policy.budgeted_rules:
        return None
    return next((rule.budget for rule in policy.rules if rule.id == rule_id), None)


def out_counter(fs: FlowState) -> Callable[[bytes], object]:
    """Stream callable for request bodies of unknown length: spend from the flow's meter (the layer
    covered each chunk before it got here); a chunk the budget cannot hold is dropped, and so is every
    later one, and the cut is flagged (`budget_cut` / `state_cut`): the stream then aborts the upstream
    request before its end and answers the client with the deny contract (early_answer.py), or resets it
    when an upstream response is already on its way."""
    meter = fs.meter
    assert fs.sandbox_id is not None and meter is not None
    state = {"cut": False}

    def count(chunk: bytes) -> object:
        if state["cut"]:
            return []  # never b"": an empty chunk is the chunked terminator on HTTP/1
        if not chunk:
            return []
        if meter.take(len(chunk)):
            fs.bytes_out += len(chunk)
            return chunk
        state["cut"] = True
        if meter.failed:  # the store failed during the top-up: not the budget (outcome: state_unavailable)
            fs.state_cut = True
        else:
            fs.budget_cut = True
        logger.info("sandbox %s: %s mid-stream; cutting", fs.sandbox_id, meter.failed or "outbound_bytes_max crossed")
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
