"""dockerwatch.CgroupWatch on a real memory cgroup (v1 where the host has the v1 memory controller, as the
test machines do; else v2): an OOM kill is reported even when the group is removed right after its last
process died (as a container's is), and the group's removal alone is never taken for one (the v1 eventfd is
signalled by both). This is what makes the docker/gVisor `memory_mb` limit report exit 121 reliably;
tests/runtimes/test_docker_adapter.py::test_memory_limit_reports_memory is the end-to-end check."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes.dockerwatch import CgroupWatch, cgroup_files

pytestmark = pytest.mark.netns
ROOT = Path("/sys/fs/cgroup")
V1 = (ROOT / "memory" / "memory.limit_in_bytes").exists()
LIMIT = 48 * 2**20
HOG = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
chunks = []
for _ in range(int(sys.argv[2])):
    chunks.append(bytearray(8 * 2**20))  # touched pages: charged to the group
"""


@pytest.fixture
def group() -> Iterator[Path]:
    path = (ROOT / "memory" if V1 else ROOT) / f"egNwatch-{os.urandom(4).hex()}"
    path.mkdir()
    try:
        if V1:
            (path / "memory.limit_in_bytes").write_text(str(LIMIT))
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(str(LIMIT))
        else:
            (path / "memory.max").write_text(str(LIMIT))
            (path / "memory.swap.max").write_text("0")
        yield path
    finally:
        for _ in range(100):
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


def run_in_group(group: Path, tmp_path: Path, chunks: int) -> tuple[int, CgroupWatch]:
    """The hog in `group`, watched from before it allocates; returns its exit status and the watch after the
    group was removed (what Docker does as a container exits) and the watch stopped."""
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOG, str(go), str(chunks)],
        preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
    )
    deadline = time.monotonic() + 30
    while str(proc.pid) not in (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
        time.sleep(0.01)
    files = cgroup_files(proc.pid)
    assert ("memory_v1" if V1 else "memory_v2") in files, files
    watch = CgroupWatch(proc.pid).start()
    go.touch()
    status = proc.wait(60)
    group.rmdir()  # the container's group goes right after its last process, before anyone asks
    watch.stop()
    return status, watch


def test_oom_kill_is_reported_after_the_group_is_gone(group: Path, tmp_path: Path) -> None:
    status, watch = run_in_group(group, tmp_path, 64)  # 512 MiB under a 48 MiB limit
    assert status == -9, status
    assert watch.oom_killed.is_set()
    assert not watch.pids_hit.is_set()


def test_removal_alone_is_not_an_oom(group: Path, tmp_path: Path) -> None:
    """Control: the same hog under the limit exits 0, and the group's removal (which signals the v1 eventfd
    too) is not reported as an OOM kill."""
    status, watch = run_in_group(group, tmp_path, 1)
    assert status == 0, status
    assert not watch.oom_killed.is_set()
