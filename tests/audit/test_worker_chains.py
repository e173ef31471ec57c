"""One chain per writer: a restarted writer (a worker of `run --workers N`, or a single gateway) continues its
own chain from its last record, even when it was killed before writing anything to its new file; chains
of other workers in the same directory are never linked to; `audit verify --per-worker` checks several
workers' files, each chain on its own."""

from __future__ import annotations

import asyncio
import shutil

from egressgate.audit.filesink import FileSink
from egressgate.audit.filewatch import chain_name, newest_rotated, rotated_name
from egressgate.audit.signer import load_public_keys
from egressgate.audit.verify import verify_files
from tests.support.audit_events import crash, http_event
from tests.support.cli import cli


def chain(path) -> list:
    """This chain's files, oldest first (rotated names sort by time, the live file last)."""
    rotated = sorted(p for p in path.parent.iterdir() if p != path and chain_name(p) == path.name)
    return [*rotated, path]


async def write(sink: FileSink, n: int, tag: str) -> None:
    for i in range(n):
        await sink.write(http_event(i, request_id=f"{tag}-{i}"))


async def test_killed_before_its_first_record_the_chain_still_continues(tmp_path, signer, pubkey):
    """Run 1 writes and stops cleanly; run 2 starts (rotating run 1's file, opening an empty one) and is
    killed before its first record; run 3 must link to run 1's last record. Before the fix the empty live
    file made run 3 start a new chain (verify: "starts a new chain"): a restarted worker's history was cut."""
    path = tmp_path / "audit" / "audit.w0.jsonl"
    first = await FileSink(path, signer).start()
    await write(first, 3, "a")
    await first.close()
    second = await FileSink(path, signer).start()
    assert path.stat().st_size == 0  # control: the state a kill leaves (chain_start comes with the 1st record)
    await crash(second)
    third = await FileSink(path, signer).start()
    await write(third, 2, "c")
    await third.close()
    files = chain(path)
    assert len(files) == 2
    reps = verify_files(files, load_public_keys([pubkey]))
    assert all(r.ok for r in reps), [r.error for r in reps]
    assert not any("new chain" in w for r in reps for w in r.warnings), [r.warnings for r in reps]
    assert reps[1].first_prev == reps[0].last_hash


async def test_a_crash_after_records_is_sealed_and_linked(tmp_path, signer, pubkey):
    """The usual kill -9: records written, no final checkpoint; the restart seals and links (the
    positive control of the test above: this path always linked)."""
    path = tmp_path / "audit" / "audit.w1.jsonl"
    first = await FileSink(path, signer).start()
    await write(first, 3, "a")
    await crash(first)
    second = await FileSink(path, signer).start()
    assert second.incidents[0]["incident"] == "crash_recovered"
    await write(second, 1, "b")
    await second.close()
    reps = verify_files(chain(path), load_public_keys([pubkey]))
    assert all(r.ok for r in reps) and reps[1].first_prev == reps[0].last_hash


async def test_another_workers_rotated_file_is_never_the_predecessor(tmp_path, signer, pubkey):
    """`audit.jsonl`'s predecessor is its own newest rotated file, never `audit.w1.<stamp>.jsonl` (a
    newer file of another chain in the same directory)."""
    own = tmp_path / "audit" / "audit.jsonl"
    other = tmp_path / "audit" / "audit.w1.jsonl"
    for p in (own, other):
        sink = await FileSink(p, signer).start()
        await write(sink, 1, p.stem)
        await sink.close()
    own_rotated = rotated_name(own)
    own.rename(own_rotated)
    own.touch()  # empty live file: linked to own_rotated
    await asyncio.sleep(0.01)
    other.rename(rotated_name(other))  # newer, and a name that starts with "audit."
    assert newest_rotated(own) == own_rotated
    assert newest_rotated(other).name.startswith("audit.w1.")
    sink = await FileSink(own, signer).start()
    await write(sink, 1, "again")
    await sink.close()
    reps = verify_files([own_rotated, own], load_public_keys([pubkey]))
    assert all(r.ok for r in reps) and reps[1].first_prev == reps[0].last_hash


def test_chain_names():
    from pathlib import Path

    assert chain_name(Path("v/audit.w3.20261130T210353_943250Z.jsonl")) == "audit.w3.jsonl"
    assert chain_name(Path("v/audit.20261130T210353_943250Z-2.jsonl")) == "audit.jsonl"
    assert chain_name(Path("v/audit.w3.jsonl")) == "audit.w3.jsonl"
    assert chain_name(Path("v/audit.jsonl")) == "audit.jsonl"


async def test_verify_per_worker_checks_each_chain(tmp_path, signer, pubkey):
    """`audit verify --per-worker` over two workers' files (rotated + live, given in shell-glob order):
    both chains verify; an edit in one worker's rotated file fails that chain (positive control); without
    the flag, verify says the files are several chains."""
    var = tmp_path / "audit"
    for slot in (0, 1):
        path = var / f"audit.w{slot}.jsonl"
        for run in range(2):  # two runs: a rotated file and the live file
            sink = await FileSink(path, signer).start()
            await write(sink, 2, f"w{slot}r{run}")
            await sink.close()
    files = sorted(str(p) for p in var.glob("audit*.jsonl"))
    assert len(files) == 4
    res = cli("audit", "verify", "--per-worker", "--public-key", str(pubkey), *files)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("OK   ") == 4 and "new chain" not in res.stderr
    res = cli("audit", "verify", "--public-key", str(pubkey), *files)
    assert "pass --per-worker" in res.stderr
    # the live file alone of each chain links to a rotated file not given: warned, not failed
    shutil.copy(files[0], tmp_path / "orig")
    lines = (tmp_path / "orig").read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b"w0r0-0", b"w0r0-X")
    open(files[0], "wb").write(b"".join(lines))  # noqa: SIM115
    res = cli("audit", "verify", "--per-worker", "--public-key", str(pubkey), *files)
    assert res.returncode == 1 and "FAIL" in res.stdout and files[0] in res.stdout, res.stdout
    assert f"OK   {files[3]}" in res.stdout  # the other worker's chain is still checked
