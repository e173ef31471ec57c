"""compose.py: the wrapper order of body stream callables, stated once and checked here.

Each test would fail if the order in compose.py changed: a phantom must never be counted against the
budget (guard before counter), the request hash must see a chunk the budget cuts (hash outermost), and a
credentialed response is counted as the upstream sent it, before it is decoded and scrubbed (counter
before scrub). Real ledger over the real in-memory state store, real scrubber, real request hasher."""

from __future__ import annotations

import asyncio
import gzip
import time
from dataclasses import dataclass, field

from egressgate.audit.reqhash import StreamingRequestHash
from egressgate.broker.inject import phantom_value
from egressgate.broker.redact import Scrubber
from egressgate.gateway.budgets import ByteLedger, in_counter, out_counter
from egressgate.gateway.compose import ScrubPlan, compose_request, compose_response
from egressgate.gateway.context import FlowState, new_request_id
from egressgate.state.base import SandboxRecord
from egressgate.state.memory import MemoryState

SECRET = "sk-live-0123456789abcdefghij"


@dataclass
class Rt:
    """The two Runtime services the counters use (the ledger and the connection cut)."""

    ledger: ByteLedger
    aborted: list[str] = field(default_factory=list)

    def abort_connection(self, client_id: str) -> bool:
        self.aborted.append(client_id)
        return True


async def _world() -> tuple[Rt, FlowState]:
    state = MemoryState()
    await state.admit(SandboxRecord(id="sbx-1", token_hash="x", policy_name="p", admitted_at=time.time()))
    ledger = ByteLedger(state)
    await ledger.load("sbx-1")
    fs = FlowState(request_id=new_request_id(), started_ns=time.time_ns(), sandbox_id="sbx-1")
    return Rt(ledger), fs


def _feed(fn, chunks: list[bytes]) -> bytes:
    out: list[bytes] = []
    for chunk in [*chunks, b""]:
        got = fn(chunk)
        out += [got] if isinstance(got, bytes) else list(got)
    return b"".join(out)


def _hasher() -> StreamingRequestHash:
    return StreamingRequestHash("POST", "https", "api.test", 443, "/", None, "")


async def test_a_phantom_is_never_counted_against_the_budget() -> None:
    rt, fs = await _world()
    hits: list = []
    clean = b"a" * 200
    stream = compose_request(_hasher(), hits.extend, out_counter(rt, fs, "c1", 10_000))
    assert _feed(stream, [clean[:90], clean[90:]]) == clean  # positive control: counted and forwarded
    assert rt.ledger.bytes_out("sbx-1") == len(clean) and not hits

    rt, fs = await _world()
    phantom = phantom_value().encode()
    body = b"b" * 30 + phantom + b"c" * 30
    hasher, reference = _hasher(), _hasher()
    stream = compose_request(hasher, hits.extend, out_counter(rt, fs, "c1", 10_000))
    out = _feed(stream, [body])
    assert hits and phantom not in out
    # guard before counter: the budget was not charged for the phantom's chunk
    assert rt.ledger.bytes_out("sbx-1") == 0 and fs.bytes_out == 0
    # hash before guard: the request hash covers what the sandbox sent, phantom included
    reference.update(body)
    assert hasher.body_hash() == reference.body_hash()
    await rt.ledger.flush()


async def test_the_request_hash_sees_the_chunk_the_budget_cuts() -> None:
    rt, fs = await _world()
    hasher, reference = _hasher(), _hasher()
    body = [b"x" * 60, b"y" * 60]
    stream = compose_request(hasher, lambda hits: None, out_counter(rt, fs, "c1", 100))
    out = _feed(stream, body)
    assert fs.budget_cut and rt.aborted == ["c1"]
    whole = b"".join(body)
    assert len(out) < len(whole) and whole.startswith(out)  # the crossing chunk never went upstream
    assert fs.bytes_out == len(out) <= 100
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
    assert rt.ledger.bytes_in("sbx-1") == len(wire)
    await rt.ledger.flush()


async def test_a_refused_response_sends_only_its_replacement() -> None:
    rt, fs = await _world()
    stream = compose_response(in_counter(rt, fs), None, b'{"error":"refused"}')
    assert callable(stream)
    assert _feed(stream, [b"upstream " + SECRET.encode()]) == b'{"error":"refused"}'
    plain = compose_response(in_counter(rt, fs), None, None)  # positive control: relayed and counted
    assert callable(plain) and _feed(plain, [b"abc"]) == b"abc" and fs.bytes_in == 3
    await asyncio.sleep(0)
    await rt.ledger.flush()
