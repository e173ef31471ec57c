"""compose.py: the wrapper order of body stream callables, stated once and checked here.

Each test would fail if the order in compose.py changed: a phantom must never be counted against the
budget (guard before counter), the request hash must see a chunk the budget cuts (hash outermost), a
credentialed response is counted as the upstream sent it, before it is decoded and scrubbed (counter
before scrub), and a route's answer filter (the MCP mediator) reads the scrubbed bytes and what it
re-encoded is scrubbed again (scrub before filter before re-scrub); a body refused on its route is
neither hashed, counted nor forwarded (refusal outermost). Real ledger over the real in-memory state
store, real scrubber, real request hasher, real MCP session; body chunks are covered by the flow's lease
before they reach the callable, as http_layer.py does."""

from __future__ import annotations

import asyncio
import gzip
import time
from dataclasses import dataclass, field

from egressgate.audit.reqhash import StreamingRequestHash
from egressgate.broker.inject import phantom_value
from egressgate.broker.redact import Scrubber
from egressgate.gateway.mcp.stream import sse_filter
from egressgate.gateway.pipeline.budgets import ByteLedger
from egressgate.gateway.shared.compose import AnswerFilter, ScrubPlan, compose_request, compose_response
from egressgate.gateway.shared.context import FlowState, new_request_id
from egressgate.gateway.shared.counters import in_counter, out_counter
from egressgate.mcp.schema import tool_hash
from egressgate.state.base import SandboxRecord
from egressgate.state.memory import MemoryState
from tests.mcp.mediator_world import body, make_world

SECRET = "sk-live-0123456789abcdefghij"


@dataclass
class Rt:
    """The two Runtime services the counters use (the ledger and the connection cut)."""

    ledger: ByteLedger
    state: MemoryState
    aborted: list[str] = field(default_factory=list)

    def abort_connection(self, client_id: str) -> bool:
        self.aborted.append(client_id)
        return True


async def _world(limit: int | None = None) -> tuple[Rt, FlowState]:
    state = MemoryState()
    await state.admit(SandboxRecord(id="sbx-1", token_hash="x", policy_name="p", admitted_at=time.time()))
    ledger = ByteLedger(state)
    fs = FlowState(request_id=new_request_id(), started_ns=time.time_ns(), sandbox_id="sbx-1")
    fs.meter = ledger.open("sbx-1", limit)
    return Rt(ledger, state), fs


async def _feed_metered(fs: FlowState, fn, chunks: list[bytes]) -> bytes:
    """As http_layer.py: each chunk is covered by the flow's lease (topped up if need be) first."""
    meter = fs.meter
    assert meter is not None
    out: list[bytes] = []
    for chunk in [*chunks, b""]:
        if chunk and not meter.cover(len(chunk)):
            await meter.top_up(len(chunk))
            meter.cover(len(chunk))  # when the store refused, the counter cuts
        got = fn(chunk)
        out += [got] if isinstance(got, bytes) else list(got)
    return b"".join(out)


def _feed(fn, chunks: list[bytes]) -> bytes:
    out: list[bytes] = []
    for chunk in [*chunks, b""]:
        got = fn(chunk)
        out += [got] if isinstance(got, bytes) else list(got)
    return b"".join(out)


async def _bytes_out(rt: Rt, fs: FlowState) -> int:
    """What the store says once the flow ended (its lease settled)."""
    assert fs.meter is not None
    fs.meter.close()
    await rt.ledger.flush()
    return (await rt.state.snapshot("sbx-1")).bytes_out


def _hasher() -> StreamingRequestHash:
    return StreamingRequestHash("POST", "https", "api.test", 443, "/", None, "")


async def test_a_phantom_is_never_counted_against_the_budget() -> None:
    rt, fs = await _world()
    hits: list = []
    clean = b"a" * 200
    stream = compose_request(_hasher(), hits.extend, out_counter(fs))
    assert await _feed_metered(fs, stream, [clean[:90], clean[90:]]) == clean  # positive control: counted
    assert await _bytes_out(rt, fs) == len(clean) and not hits

    rt, fs = await _world()
    phantom = phantom_value().encode()
    body = b"b" * 30 + phantom + b"c" * 30
    hasher, reference = _hasher(), _hasher()
    stream = compose_request(hasher, hits.extend, out_counter(fs))
    out = await _feed_metered(fs, stream, [body])
    assert hits and phantom not in out
    # guard before counter: the budget was not charged for the phantom's chunk
    assert await _bytes_out(rt, fs) == 0 and fs.bytes_out == 0
    # hash before guard: the request hash covers what the sandbox sent, phantom included
    reference.update(body)
    assert hasher.body_hash() == reference.body_hash()
    await rt.ledger.flush()


async def test_the_request_hash_sees_the_chunk_the_budget_cuts() -> None:
    hasher, reference = _hasher(), _hasher()
    body = [b"x" * 60, b"y" * 60]
    rt, fs = await _world(limit=100)
    stream = compose_request(hasher, lambda hits: None, out_counter(fs))
    out = await _feed_metered(fs, stream, body)
    assert fs.budget_cut and rt.aborted == []  # the stream answers the client (early_answer.py), no reset
    whole = b"".join(body)
    assert len(out) < len(whole) and whole.startswith(out)  # the crossing chunk never went upstream
    assert fs.bytes_out == len(out) <= 100
    assert await _bytes_out(rt, fs) == len(out)  # the unused lease went back
    for chunk in body:
        reference.update(chunk)
    assert hasher.body_hash() == reference.body_hash()  # hash outermost: what the sandbox sent
    await rt.ledger.flush()


async def test_a_scrubbed_response_is_counted_as_the_upstream_sent_it() -> None:
    rt, fs = await _world()
    plain = b"token=" + SECRET.encode() + b";" + b"z" * 500
    wire = gzip.compress(plain)
    errors: list = []
    plan = ScrubPlan(["gzip"], Scrubber([SECRET]), 1 << 20, errors.append)
    stream = compose_response(in_counter(rt, fs), plan, None)
    assert callable(stream)
    out = _feed(stream, [wire[:20], wire[20:]])
    assert not errors and SECRET.encode() not in out and out.startswith(b"token=")
    # counter before decode+scrub: the wire (gzip) bytes, not the decoded, scrubbed ones
    assert fs.bytes_in == len(wire) != len(out)
    await rt.ledger.flush()
    assert (await rt.state.snapshot("sbx-1")).bytes_in == len(wire)


async def test_a_refused_response_sends_only_its_replacement() -> None:
    rt, fs = await _world()
    stream = compose_response(in_counter(rt, fs), None, b'{"error":"refused"}')
    assert callable(stream)
    assert _feed(stream, [b"upstream " + SECRET.encode()]) == b'{"error":"refused"}'
    plain = compose_response(in_counter(rt, fs), None, None)  # positive control: relayed and counted
    assert callable(plain) and _feed(plain, [b"abc"]) == b"abc" and fs.bytes_in == 3
    await asyncio.sleep(0)
    await rt.ledger.flush()


def _leaky_listing(jid: int) -> bytes:
    """An SSE tools/list answer: `note` (allowed by mediator_world's policy) whose description leaks SECRET
    raw and JSON-escaped, and `delete_ticket` (denied: the mediator drops it)."""
    escaped = "".join(f"\\u{ord(c):04x}" for c in SECRET)
    listing = (
        '{"jsonrpc":"2.0","id":'
        + str(jid)
        + ',"result":{"tools":[{"name":"note","description":"raw '
        + SECRET
        + " escaped "
        + escaped
        + '","inputSchema":{"type":"object"}},'
        '{"name":"delete_ticket","inputSchema":{"type":"object"}}]}}'
    )
    return f"event: message\r\ndata: {listing}\r\n\r\n".encode()


async def test_an_mcp_answer_is_counted_then_scrubbed_then_mediated_then_scrubbed_again(tmp_path) -> None:
    """The MCP route's filter (gateway/mcp/stream.py sse_filter, a real McpSession) as compose.py's step 3:
    the counter counts the upstream's wire bytes, the mediator reads the scrubbed text (the tool hash it
    keeps is the scrubbed tool's), and nothing of the secret reaches the client. Control: the same answer
    without the scrub plan and the re-scrub reaches the mediator and the client with the secret in it."""
    world = await make_world(tmp_path, MemoryState())
    try:
        outs = []
        control = SandboxRecord(
            id="sbx-b", token_hash="y", policy_name="mcp-med", admitted_at=time.time(), labels={"tenant": "acme"}
        )
        await world.rt.state.admit(control)  # its own first sight of the tools (pins are per sandbox)
        for credentialed in (True, False):
            session = world.session(sandbox=None if credentialed else control)
            assert (await session.from_client(body({"jsonrpc": "2.0", "id": 51, "method": "tools/list"}))).forward
            rt, fs = await _world()
            scrubber = Scrubber([SECRET])
            plan = ScrubPlan([], scrubber, 1 << 20, lambda exc: None) if credentialed else None
            answer = AnswerFilter(
                lambda inner, s=session: sse_filter(inner, s, 1 << 20, [], None, None, print),
                scrubber if credentialed else None,
            )
            stream = compose_response(in_counter(rt, fs), plan, None, answer)
            assert callable(stream)
            wire = _leaky_listing(51)
            out = _feed(stream, [wire[:70], wire[70:150], wire[150:]])
            assert fs.bytes_in == len(wire) != len(out)  # counter first: the wire bytes
            await rt.ledger.flush()
            assert (await rt.state.snapshot("sbx-1")).bytes_in == len(wire)
            assert b"delete_ticket" not in out and b'"note"' in out  # mediated
            outs.append((out, session.server_side.tool_hashes["note"]))
            await session.server_side.settle()  # its first-sight pins land before the world closes
        (scrubbed, seen_scrubbed), (control, seen_raw) = outs
        description = "raw [REDACTED] escaped [REDACTED]"
        assert SECRET.encode() not in scrubbed and description.encode() in scrubbed
        tool = {"name": "note", "description": description, "inputSchema": {"type": "object"}}
        assert seen_scrubbed == tool_hash(tool)  # scrub before filter: the mediator read the scrubbed text
        assert SECRET.encode() in control  # control: the escaped one decoded by the re-encoding, the raw one
        assert seen_raw == tool_hash({**tool, "description": f"raw {SECRET} escaped {SECRET}"})
    finally:
        await world.rt.audit.close()


async def test_a_body_refused_on_its_route_is_neither_hashed_counted_nor_forwarded() -> None:
    rt, fs = await _world()
    cuts: list[int] = []
    hasher = _hasher()
    stream = compose_request(hasher, lambda hits: None, out_counter(fs), lambda: cuts.append(1))
    assert await _feed_metered(fs, stream, [b'{"jsonrpc":"2.0"}', b"more"]) == b""
    assert cuts == [1] and fs.bytes_out == 0 and await _bytes_out(rt, fs) == 0
    assert hasher.body_hash() == _hasher().body_hash()  # nothing of it was hashed
    rt, fs = await _world()
    control = compose_request(_hasher(), lambda hits: None, out_counter(fs))  # no refusal: relayed and counted
    assert await _feed_metered(fs, control, [b"abc"]) == b"abc" and fs.bytes_out == 3
    await rt.ledger.flush()
