"""Kernel-enforced byte limits (diskfs.py), on real mounts, written by the sandbox uid: the bounded tmpfs and
the loop-mounted ext4 image refuse with ENOSPC what a watcher of apparent sizes missed (fallocate KEEP_SIZE,
sparse files, an unlinked file held open, inode floods); positive control: the same on an unbounded dir works."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from egressgate.runtimes import diskfs, records
from egressgate.runtimes.base import SANDBOX_UID
from egressgate.runtimes.diskfs import IMAGE, DiskLimits, mounted
from tests.runtimes.harness import base_dir, remove
from tests.runtimes.runs import loops_freed

MiB = 1024 * 1024
LIMIT = 4 * MiB


def as_sandbox(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "sh", "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(params=["tmpfs", "image"])
def bounded(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """(bounded workspace, unbounded control dir) of a fresh run id; everything is unmounted afterwards."""
    base = base_dir("/var/tmp")
    state = base / "state"
    state.mkdir()
    run_id = records.new_run_id()
    ws = base / "ws"
    ws.mkdir()
    os.chown(ws, SANDBOX_UID, SANDBOX_UID)
    control = base / "control"
    control.mkdir()
    os.chown(control, SANDBOX_UID, SANDBOX_UID)
    disks = DiskLimits(run_id, state)
    if request.param == "tmpfs":
        disks.temporary_workspace(ws, LIMIT, SANDBOX_UID)
    else:
        disks.persistent_workspace(ws, LIMIT, SANDBOX_UID)
    try:
        yield ws, control
    finally:
        disks.release()
        assert mounted(ws) is None and loops_freed(ws / IMAGE) == []
        remove(base)


def test_fallocate_keep_size_beyond_the_limit_gets_enospc(bounded):
    ws, control = bounded
    script = ": > f; fallocate -n -l 64M f && echo allocated; du -k f"
    res = as_sandbox(script, ws)
    assert "allocated" not in res.stdout and "No space left" in res.stderr, res
    assert int(as_sandbox("du -sk .", ws).stdout.split()[0]) * 1024 <= LIMIT
    ok = as_sandbox(script, control)  # positive control: the same call on an unbounded directory
    assert "allocated" in ok.stdout and int(ok.stdout.split()[-2]) >= 64 * 1024, ok


def test_sparse_file_writes_count_their_blocks(bounded):
    ws, _ = bounded
    # a 1 GiB sparse file costs nothing; writing 1 MiB every 64 MiB into it fills the limit
    script = (
        "truncate -s 1G s && for i in 0 1 2 3 4 5 6 7; do "
        "dd if=/dev/zero of=s bs=1M count=1 seek=$((i*64)) conv=notrunc 2>/dev/null || { echo full; exit 0; }; "
        "done; echo wrote"
    )
    res = as_sandbox(script, ws)
    assert "full" in res.stdout, res


def test_unlinked_open_file_keeps_its_blocks(bounded):
    ws, _ = bounded
    script = (
        "exec 3>held; rm held; head -c 3145728 /dev/zero >&3; head -c 2097152 /dev/zero > more && echo fit || echo full"
    )
    res = as_sandbox(script, ws)
    assert "full" in res.stdout, res


def test_inode_flood_is_bounded(bounded):
    ws, control = bounded
    # each file made by the shell itself (open O_CREAT, as touch does), not by a touch process per file: the
    # same inodes, without 6,000 fork+execs per case (they were the module's CPU and ~20 s of its wall time)
    script = (
        "i=0; while [ $i -lt 3000 ]; do true 2>/dev/null > f$i || { echo stopped=$i; exit 0; }; "
        "i=$((i+1)); done; echo all"
    )
    res = as_sandbox(script, ws)
    assert "stopped=" in res.stdout and int(res.stdout.split("=")[1]) <= diskfs.nr_inodes(LIMIT), res
    assert "all" in as_sandbox(script, control).stdout


def test_just_under_the_limit_fits_and_is_not_full(bounded):
    ws, _ = bounded
    # ext4 keeps ~10% of a small image for its metadata; tmpfs gives all of it
    margin = LIMIT // 8
    res = as_sandbox(f"head -c {LIMIT - 2 * margin} /dev/zero > f && echo fit", ws)
    assert "fit" in res.stdout, res
    assert os.statvfs(ws).f_bavail > 0


def test_image_persists_with_content_and_migrates_an_existing_directory():
    base = base_dir("/var/tmp")
    state = base / "state"
    state.mkdir()
    ws = base / "ws"
    ws.mkdir()
    (ws / "input.txt").write_text("from the operator\n")
    os.mkfifo(ws / "fifo")  # copied as a fifo, never opened
    try:
        for round_ in (1, 2):
            disks = DiskLimits(records.new_run_id(), state)
            disks.persistent_workspace(ws, LIMIT, SANDBOX_UID)
            try:
                assert (ws / "input.txt").read_text() == "from the operator\n"
                assert (ws / "fifo").is_fifo()
                if round_ == 1:
                    as_sandbox("echo kept > out.txt", ws)
                else:
                    assert (ws / "out.txt").read_text() == "kept\n"
                assert diskfs.mounted(ws)[0] == "ext4"
            finally:
                disks.release()
            assert sorted(os.listdir(ws)) == [IMAGE] and (ws / IMAGE).stat().st_size == LIMIT
            assert loops_freed(ws / IMAGE) == []
    finally:
        remove(base)
