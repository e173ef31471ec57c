"""An operator's `mv` racing the sink's own size rotation (issue 23, item 3).

The interleavings are driven, not timed: the sink calls `_trail.rotation_step(name)` at each step of `Trail.rotate`
(check, seal, rename, locate, reopen, opened), and the test's outside change runs exactly there — a plain `mv`,
logrotate's `create` (mv + an empty file at the name), a foreign non-empty file put at the name, or a move out
of the audit directory. Whatever the interleaving, every file of the trail verifies (linked, sealed), no
record is lost or written twice, and a move of the file being written is recorded as a `file_moved`
incident. Before the fix a `mv` between the identity check and the rename put the final checkpoint in the
moved file and continued the old chain (no `chain_start`, no incident) in the next one: `verify` failed.

Positive control: the same trail with one record removed from a sealed file fails verification.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from egressgate.audit.event import AuditUnavailable
from egressgate.audit.find import iter_records
from egressgate.audit.signer import load_public_keys
from egressgate.audit.verify import GENESIS, verify_file, verify_files
from tests.support.audit_events import http_event

STEPS = ["check", "seal", "rename", "locate", "reopen", "opened"]
ACTIONS = ["mv", "mv+create", "mv+foreign", "mv-elsewhere"]


def _outside(action: str, path: Path, elsewhere: Path) -> bool:
    """The operator's change; True when it moved the file that was at `path`."""
    if not path.exists():
        moved = False  # the sink renamed it already: the operator's `mv` finds nothing (it fails)
    else:
        dest = elsewhere / "audit.moved.jsonl" if action == "mv-elsewhere" else path.with_name("audit.moved.jsonl")
        os.rename(path, dest)
        moved = True
    if action == "mv+create":
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    elif action == "mv+foreign":
        path.write_bytes(b"not an audit record\n")
    return moved


def _chain_order(files: list[Path], keys) -> list[Path]:
    """The trail's files in chain order (each file's first chain.prev is its predecessor's last hash)."""
    reports = {f: verify_file(f, keys, require_seal=False) for f in files}
    by_prev = {r.first_prev: f for f, r in reports.items()}
    order = [by_prev[GENESIS]]
    while (nxt := by_prev.get(reports[order[-1]].last_hash)) is not None:
        order.append(nxt)
    assert sorted(order) == sorted(files), (order, files)  # every file is on the one chain
    return order


def _ids(files: list[Path]) -> list[str]:
    return [
        f.record.attributes["egressgate.request.id"]
        for f in iter_records(files)
        if f.record.attributes.get("egressgate.operation") == "http_request"
    ]


def _incidents(files: list[Path]) -> list[str]:
    return [
        str(f.record.attributes.get("egressgate.incident"))
        for f in iter_records(files)
        if f.record.attributes.get("egressgate.operation") == "audit_incident"
    ]


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("step", STEPS)
async def test_outside_move_at_any_step_of_rotation_leaves_a_verifying_trail(make_sink, pubkey, tmp_path, step, action):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sink = await make_sink(max_bytes=4000, checkpoint_every=5, watch_interval=3600)  # only driven checks
    moved: list[bool] = []

    def at(name: str, _target: Path | None) -> None:
        if name == step and not moved:
            moved.append(_outside(action, sink.path, elsewhere))

    sink._trail.rotation_step = at
    sent = []
    for i in range(60):  # several rotations; the outside change happens in the first
        ev = http_event(i)
        await sink.write(ev)
        sent.append(ev.request_id)
    await sink.close()
    assert moved, "the rotation step was never reached"
    assert sink.rotations >= 2
    audit_dir = sink.path.parent
    foreign = [p for p in audit_dir.iterdir() if p.read_bytes() == b"not an audit record\n"]
    assert len(foreign) == (1 if action == "mv+foreign" else 0)  # moved aside, never appended to
    files = [p for p in [*audit_dir.iterdir(), *elsewhere.iterdir()] if p.suffix == ".jsonl" and p not in foreign]
    keys = load_public_keys([pubkey])
    order = _chain_order(files, keys)
    reports = verify_files(order, keys)
    assert all(r.ok for r in reports), [(r.path, r.error) for r in reports]
    assert all(r.sealed for r in reports), [(r.path, r.sealed) for r in reports]
    assert sorted(_ids(order)) == sorted(sent)  # nothing lost, nothing twice
    if moved[0]:
        assert "file_moved" in _incidents(order), _incidents(order)
        assert any("file_moved" in w for r in reports for w in r.warnings)
    else:
        assert "file_moved" not in _incidents(order)

    # positive control: a record removed from a sealed file of this trail is caught
    victim = next(f for f in order if len(f.read_bytes().splitlines()) >= 3)
    lines = victim.read_bytes().splitlines(keepends=True)
    del lines[1]
    victim.write_bytes(b"".join(lines))
    assert not all(r.ok for r in verify_files(order, keys))


async def test_rotation_without_outside_change_records_no_incident(make_sink, pubkey):
    """Control: plain rotations (the hook runs, does nothing) verify and record no incident."""
    sink = await make_sink(max_bytes=4000, checkpoint_every=5, watch_interval=3600)
    seen: list[str] = []
    sink._trail.rotation_step = lambda name, _target: seen.append(name)
    for i in range(40):
        await sink.write(http_event(i))
    await sink.close()
    assert seen[:6] == STEPS
    files = [p for p in sink.path.parent.iterdir() if p.suffix == ".jsonl"]
    keys = load_public_keys([pubkey])
    order = _chain_order(files, keys)
    assert order[-1] == sink.path
    assert all(r.ok and r.sealed for r in verify_files(order, keys))
    assert _incidents(order) == []


async def test_a_failed_rename_fails_one_batch_and_never_appends_to_the_sealed_file(make_sink, pubkey):
    """Nothing moved the file, but the rename itself fails (here: a directory took the rotated name): the
    batch is refused (AuditUnavailable: its caller denies), the sealed file is moved aside by the next
    batch, never appended to, and the trail verifies. Control: the next writes succeed."""
    sink = await make_sink(max_bytes=4000, checkpoint_every=5, watch_interval=3600)
    blocked: list[Path] = []

    def at(name: str, target: Path | None) -> None:
        if name == "rename" and target is not None and not blocked:
            target.mkdir()  # os.rename(file, directory) fails: IsADirectoryError
            blocked.append(target)

    sink._trail.rotation_step = at
    refused = 0
    for i in range(30):
        try:
            await sink.write(http_event(i))
        except AuditUnavailable:
            refused += 1
    await sink.close()
    assert blocked and refused == 1
    blocked[0].rmdir()
    files = [p for p in sink.path.parent.iterdir() if p.suffix == ".jsonl"]
    keys = load_public_keys([pubkey])
    order = _chain_order(files, keys)
    reports = verify_files(order, keys)
    assert all(r.ok and r.sealed for r in reports), [(r.path, r.error) for r in reports]
    assert len(_ids(order)) == 29 and "file_moved" not in _incidents(order)
