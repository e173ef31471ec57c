"""compose.py: the wrapper order of body stream callables, stated once and checked here.

Each test would fail if the order in compose.py changed: a phantom must never be counted against the
budget (guard before counter), the request hash must see a chunk the budget cuts (hash outermost), and a
credentialed response is counted as the upstream sent it, before it is decoded and scrubbed (counter
before scrub). Real ledger over the real in-memory state store, real scrubber, real request hasher; body
chunks are covered by the flow's lease before they reach the callable, as http_layer.py does."""

from __future__ import annotations

import asyncio
import gzip
import time
from dataclasses import dataclass, field

from egressgate.audit.reqhash import StreamingRequestHash
from egressgate.broker.inject import phantom_value
from egressgate.broker.redact import Scrubber
from egressgate.gateway.pipeline.budgets import ByteLedger
from egressgate.gateway.shared.compose import ScrubPlan, compose_request, compose_response
from egressgate.gateway.shared.context import FlowState, new_request_id
from egressgate.gateway.shared.counters import in_counter, out_counter
from egressgate.state.base import SandboxRecord
from egressgate.state.memory import MemoryState

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
