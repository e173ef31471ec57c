"""The memory backend's snapshots: always current, never changed after they were handed out."""

from __future__ import annotations

from egressgate.state.base import SandboxRecord
from egressgate.state.memory import MemoryState


async def _admitted() -> MemoryState:
    state = MemoryState()
    await state.admit(SandboxRecord(id="sbx", token_hash="x", policy_name="p", admitted_at=1.0,
                                    labels={"team": "a"}))
    return state


async def test_snapshot_shows_every_change_and_old_snapshots_stay_as_they_were():
    state = await _admitted()
    first = await state.snapshot("sbx")
    assert first.seen_hosts == frozenset() and dict(first.rule_usage) == {} and dict(first.labels) == {"team": "a"}
    await state.record_request("sbx", "a.example", "r1", 10)
    assert await state.reserve_out("sbx", 10, 10, None) == 10
    await state.add_in("sbx", 5)
    second = await state.snapshot("sbx")
    assert second.seen_hosts == {"a.example"}
    assert second.rule_usage["r1"].requests == 1 and second.rule_usage["r1"].bytes == 10
    assert (second.bytes_out, second.bytes_in) == (10, 5)
    await state.record_request("sbx", "a.example", "r1", 7)  # same host, same rule: usage still counts
    third = await state.snapshot("sbx")
    assert third.rule_usage["r1"].requests == 2 and third.rule_usage["r1"].bytes == 17
    await state.record_request("sbx", "b.example", None, 0)
    fourth = await state.snapshot("sbx")
    assert fourth.seen_hosts == {"a.example", "b.example"}
    # what was handed out earlier did not move (decisions and audit records hold these values)
    assert first.seen_hosts == frozenset() and dict(first.rule_usage) == {}
    assert second.seen_hosts == {"a.example"} and second.rule_usage["r1"].requests == 1
    assert third.rule_usage["r1"].requests == 2


async def test_unchanged_views_are_shared_not_copied():
    state = await _admitted()
    await state.record_request("sbx", "a.example", "r1", 1)
    a, b = await state.snapshot("sbx"), await state.snapshot("sbx")
    assert a.seen_hosts is b.seen_hosts and a.rule_usage is b.rule_usage and a.labels is b.labels
    await state.record_request("sbx", "a.example", None, 0)  # nothing new: the views stay
    c = await state.snapshot("sbx")
    assert c.seen_hosts is a.seen_hosts and c.rule_usage is a.rule_usage


async def test_readmission_shows_the_new_labels():
    state = await _admitted()
    assert dict((await state.snapshot("sbx")).labels) == {"team": "a"}
    await state.admit(SandboxRecord(id="sbx", token_hash="x", policy_name="p", admitted_at=2.0, labels={"team": "b"}))
    assert dict((await state.snapshot("sbx")).labels) == {"team": "b"}
