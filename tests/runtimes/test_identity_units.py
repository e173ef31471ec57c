"""Per-run host uids (egressgate/runtimes/identity.py) without a gateway: the range key is validated, the
allocation is atomic across concurrent processes, a uid is reused after its record goes and skipped while
a host process still runs as it, and a workspace changes hands without following any symlink."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time
from pathlib import Path

import pytest

from egressgate.config import ConfigError, load_config
from egressgate.runtimes import addressing, identity, records
from egressgate.runtimes.workload import prepare_workspace, release_workspace
from tests.runtimes.harness import base_dir, remove
from tests.support.launcher import private_uid_range

SUBNET = "198.18.128.0/24"  # 64 slots: more than the uids of a test range


def _range() -> tuple[int, int]:
    first, last = private_uid_range().split("-")
    return int(first), int(last)


@pytest.mark.parametrize(("value", "problem"), [
    ("1000-2000", "overlaps the host's own ids"), ("0-70000", "overlaps"), ("65534-70000", "overlaps"),
    ("70000-69999", "larger than the last"), ("70000", "FIRST-LAST"), ("a-b", "FIRST-LAST"),
    ("70000-4294967295", "largest valid uid")])
def test_range_key_is_validated(value: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as info:
        identity.parse_range(value)
    assert "runtime.uid_range" in str(info.value)
    with pytest.raises(ConfigError, match="uid_range"):
        load_config(None, {"runtime": {"uid_range": value}})


def test_default_range_is_above_the_host_ids() -> None:
    first, last = identity.parse_range(identity.DEFAULT_UID_RANGE)
    assert first >= 65536 and last < 100000  # below useradd's /etc/subuid ranges
    assert load_config(None, {}).runtime.uid_range == identity.DEFAULT_UID_RANGE


def _allocate(state_dir: str, run_id: str, uid_range: tuple[int, int], out: multiprocessing.Queue) -> None:
    _, uid = addressing.allocate_run(Path(state_dir), SUBNET, run_id, {"owner_pid": os.getpid()}, uid_range)
    out.put((run_id, uid))


def test_parallel_allocations_get_distinct_uids_reused_after_free(tmp_path: Path) -> None:
    first, _ = uid_range = _range()
    small = (first, first + 7)
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()
    ids = [records.new_run_id() for _ in range(8)]
    procs = [ctx.Process(target=_allocate, args=(str(tmp_path), rid, small, out)) for rid in ids]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
    assert sorted(got.values()) == list(range(first, first + 8))  # atomic: no uid handed out twice
    for rid, uid in got.items():
        assert records.read(tmp_path, rid)["uid"] == uid == records.read(tmp_path, rid)["gid"]
    with pytest.raises(identity.UidsExhausted, match=r"runtime.uid_range .* sandbox gc"):
        addressing.allocate_run(tmp_path, SUBNET, records.new_run_id(), {}, small)
    records.remove(tmp_path, ids[5])  # a freed uid is reused
    assert addressing.allocate_run(tmp_path, SUBNET, records.new_run_id(), {}, small)[1] == got[ids[5]]
    assert uid_range[1] >= first + 7


def test_a_uid_that_owns_a_host_process_is_skipped(tmp_path: Path) -> None:
    """A leftover the records no longer name (e.g. an escaped process) keeps its uid from a new run; the
    kill of a dead run's uid ends it."""
    first, _ = _range()
    holder = subprocess.Popen(["setpriv", f"--reuid={first}", f"--regid={first}", "--clear-groups",
                               "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.stat(f"/proc/{holder.pid}").st_uid != first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert addressing.allocate_run(tmp_path, SUBNET, records.new_run_id(), {}, (first, first + 1))[1] == first + 1
        assert identity.kill_uid(first) == [holder.pid]
        assert holder.wait(10) == -9
        assert identity.kill_uid(0) == [] and identity.kill_uid(65534) == []  # never the host's own uids
    finally:
        holder.kill()
        holder.wait()


def test_workspace_changes_hands_without_following_links() -> None:
    tmp_path = base_dir()  # traversable by any uid (pytest's tmp_path is under a 0700 directory)
    try:
        _workspace_changes_hands(tmp_path)
    finally:
        remove(tmp_path)


def _workspace_changes_hands(tmp_path: Path) -> None:
    first, _ = _range()
    new = first + 1
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.write_text("host file")
    os.chown(outside, first, first)  # owned by a sandbox uid, but outside the workspace
    for name, owner in (("sub/old-run", first), ("legacy", 65534), ("operator", 0)):
        (ws / name).write_text(name)
        os.chown(ws / name, owner, owner)
    (ws / "sub" / "old-run").chmod(0o4755)  # a set-id bit a sandbox planted
    os.chown(ws / "sub", first, first)
    os.symlink(outside, ws / "link")
    os.lchown(ws / "link", first, first)
    assert prepare_workspace(ws, new, (first, first + 255)) == ws.resolve()
    owners = {p.name: os.lstat(p).st_uid for p in [ws, *ws.rglob("*")]}
    assert owners == {"ws": new, "sub": new, "old-run": new, "legacy": new, "link": new, "operator": 0}
    assert os.stat(outside).st_uid == first  # the link's target was not followed
    assert not (ws / "sub" / "old-run").stat().st_mode & 0o4000  # the chown cleared the set-id bit
    # the end of the run: its files go to root (a later run given the same uid reads none of them)
    assert release_workspace(ws, new) == 5
    assert {p.name: os.lstat(p).st_uid for p in [ws, *ws.rglob("*")]} == dict.fromkeys(owners, 0)
    assert release_workspace(ws, 0) == 0  # never for the host's own uids
