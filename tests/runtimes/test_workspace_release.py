"""A persistent workspace whose image a finished run's container namespace still holds (diskfs.wait_released).

Seen in a full run under load: the second of two back-to-back gVisor runs on one workspace was refused "in
use by another run (its image is attached)" because runsc's gofer let go of the first run's mount namespace
a moment after the container was removed. Here another mount namespace (`unshare --mount`) holds the loop
mount exactly that way: the device is autoclear and no longer mounted in ours.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes import diskfs
from egressgate.runtimes.diskfs import IMAGE, DiskLimitError, DiskLimits, loops_of, mounted

pytestmark = pytest.mark.netns

MiB = 1024 * 1024
SIZE = 8 * MiB


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[Path]:
    ws = tmp_path / "ws"
    ws.mkdir()
    image = ws / IMAGE
    with open(image, "wb") as fh:
        fh.truncate(SIZE)
    subprocess.run(["mke2fs", "-t", "ext4", "-q", "-F", "-O", "^has_journal", str(image)], check=True)
    yield ws
    while mounted(ws) is not None:
        diskfs.unmount(ws)


def hold_in_another_namespace(ws: Path) -> subprocess.Popen:
    """Mount the image here, let a new mount namespace copy that mount, unmount it here: the loop device
    (autoclear) stays attached as long as the other namespace lives, as a removed container's does."""
    subprocess.run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev", str(ws / IMAGE), str(ws)], check=True)
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "600"])
    deadline = time.monotonic() + 30
    ours = os.readlink("/proc/self/ns/mnt")
    while os.readlink(f"/proc/{holder.pid}/ns/mnt") == ours:  # until unshare(2) has made its copy
        assert time.monotonic() < deadline and holder.poll() is None, "unshare did not start"
        time.sleep(0.02)
    assert str(ws) in Path(f"/proc/{holder.pid}/mounts").read_text()
    diskfs.unmount(ws)
    assert mounted(ws) is None and loops_of(ws / IMAGE), "the other namespace should hold the device"
    return holder


def end(holder: subprocess.Popen) -> None:
    holder.kill()
    holder.wait(30)


def test_the_next_run_waits_for_a_finished_runs_namespace_to_let_go(workspace: Path, tmp_path: Path) -> None:
    holder = hold_in_another_namespace(workspace)
    threading.Timer(1.0, end, args=(holder,)).start()  # the container's namespace goes a moment later
    disks = DiskLimits("0123456789", tmp_path / "state")
    (tmp_path / "state").mkdir()
    disks.persistent_workspace(workspace, SIZE, 0)  # before the fix: DiskLimitError "in use by another run"
    assert holder.poll() is not None  # it did wait for the namespace to go
    assert mounted(workspace) is not None and mounted(workspace)[0] == "ext4"


def test_a_device_still_held_when_the_wait_ends_is_refused(
    workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: a namespace that never lets go (a leftover process) is still refused, never mounted
    twice; only the wait is added."""
    monkeypatch.setattr(diskfs, "RELEASE_WAIT", 1.0)
    holder = hold_in_another_namespace(workspace)
    try:
        disks = DiskLimits("0123456789", tmp_path / "state")
        (tmp_path / "state").mkdir()
        started = time.monotonic()
        with pytest.raises(DiskLimitError, match="in use by another run"):
            disks.persistent_workspace(workspace, SIZE, 0)
        assert time.monotonic() - started >= 1.0
        assert mounted(workspace) is None
    finally:
        end(holder)


def test_a_live_runs_mount_is_refused_at_once(workspace: Path, tmp_path: Path) -> None:
    """A mount in our namespace is a live run: no wait (RELEASE_WAIT is 60 s; this must take far less)."""
    subprocess.run(["mount", "-t", "ext4", "-o", "loop", str(workspace / IMAGE), str(workspace)], check=True)
    disks = DiskLimits("0123456789", tmp_path / "state")
    (tmp_path / "state").mkdir()
    started = time.monotonic()
    with pytest.raises(DiskLimitError, match="in use by another run"):
        disks.persistent_workspace(workspace, SIZE, 0)
    assert time.monotonic() - started < diskfs.RELEASE_WAIT / 2
