"""workspace.max_bytes: a real workload filling its workspace is found over the limit and killed, within the
documented overshoot bound; what is counted (regular files, by lstat, each inode once, one file system)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

from egressgate.runtimes.limits import WorkspaceWatch
from tests.runtimes import limits_support
from tests.runtimes.limits_support import SIGKILL, exit_signal, require_cgroups, wait_for

runs = limits_support.runs  # the fixture

MiB = 1024 * 1024
FILL = "i=0; while :; do i=$((i+1)); head -c 1048576 /dev/zero > f$i; sleep 0.05; done"  # ~20 MiB/s, forever


def test_workspace_fill_is_detected_and_the_run_killed_within_the_bound(runs, tmp_path):
    require_cgroups()
    ws = tmp_path / "ws"
    ws.mkdir()
    limits = runs.create("ws", {})
    proc = runs.spawn(limits, ["/bin/sh", "-c", FILL], cwd=ws)
    fired = threading.Event()

    def on_exceed() -> None:
        limits.kill_all()
        fired.set()

    watch = WorkspaceWatch(ws, 4 * MiB, on_exceed, interval=0.2)
    started = time.monotonic()
    watch.start()
    try:
        assert fired.wait(20)
    finally:
        watch.stop()
    took = time.monotonic() - started
    proc.wait(5)
    assert exit_signal(proc) == SIGKILL and limits.pids() == []
    assert watch.exceeded and watch.used > 4 * MiB
    held = watch.scan()
    # bound: max + write rate x 2 passes (one pass per tick here: interval + walk), with room for a slow machine
    rate = 20 * MiB
    assert held <= 4 * MiB + rate * (2 * 0.2 + 0.4), held
    assert took < 5


def test_positive_control_a_workload_under_the_limit_is_left_alone(runs, tmp_path):
    require_cgroups()
    ws = tmp_path / "ws"
    ws.mkdir()
    limits = runs.create("ws-ok", {})
    calls = []
    watch = WorkspaceWatch(ws, 4 * MiB, lambda: calls.append(1), interval=0.05)
    watch.start()
    proc = runs.spawn(limits, ["/bin/sh", "-c", "for i in 1 2 3; do head -c 1048576 /dev/zero > f$i; done; sleep 0.5"],
                      cwd=ws)
    assert proc.wait(10) == 0
    watch.stop()
    assert not watch.exceeded and calls == [] and watch.scan() == 3 * MiB


def test_symlinks_are_not_followed(tmp_path):
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "big").write_bytes(bytes(8 * MiB))
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "link-to-file").symlink_to(outside / "big")
    (ws / "link-to-dir").symlink_to(outside)
    (ws / "small").write_bytes(bytes(100))
    watch = WorkspaceWatch(ws, MiB, lambda: None)
    assert watch.scan() == 100 and not watch.exceeded
    # control: the same bytes as a real file in the workspace are counted
    os.link(outside / "big", ws / "copy")
    assert watch.scan() == 8 * MiB + 100 and watch.exceeded


def test_hard_links_count_once_and_sparse_files_at_their_length(tmp_path):
    ws = tmp_path / "ws"
    (ws / "a" / "b").mkdir(parents=True)
    (ws / "a" / "f").write_bytes(bytes(2 * MiB))
    os.link(ws / "a" / "f", ws / "a" / "b" / "f2")
    os.link(ws / "a" / "f", ws / "f3")
    assert WorkspaceWatch(ws, 10 * MiB, lambda: None).scan() == 2 * MiB
    with (ws / "sparse").open("wb") as f:
        f.truncate(64 * MiB)
    watch = WorkspaceWatch(ws, 10 * MiB, lambda: None)
    assert watch.scan() == 66 * MiB and watch.exceeded


def test_work_per_tick_is_bounded(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(100):
        (ws / f"e{i}").write_bytes(b"x")
    watch = WorkspaceWatch(ws, MiB, lambda: None, entries_per_tick=10)
    ticks = 0
    while watch.passes == 0:
        watch.tick()
        ticks += 1
        assert ticks <= 12
    assert ticks >= 10 and watch.used == 100


def test_on_exceed_runs_once_and_partial_passes_count(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(50):
        (ws / f"f{i}").write_bytes(bytes(1024))
    calls = []
    watch = WorkspaceWatch(ws, 10 * 1024, lambda: calls.append(1), entries_per_tick=20)
    assert watch.tick()  # 20 KiB seen in the first tick: over the limit before the pass ends
    assert watch.tick() and calls == [1]


def test_other_file_systems_are_not_descended(tmp_path):
    """A mount inside the workspace (made here in a private mount namespace) is not walked."""
    require_cgroups()  # root
    ws = tmp_path / "ws"
    (ws / "mnt").mkdir(parents=True)
    (ws / "own").write_bytes(bytes(1000))
    code = textwrap.dedent(f"""
        import os
        from egressgate.runtimes.workspace import WorkspaceWatch
        with open({str(ws / "mnt" / "big")!r}, "wb") as f:
            f.write(bytes(4 << 20))
        print(WorkspaceWatch({str(ws)!r}, 1 << 20, lambda: None).scan())
        """)
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f'mount -t tmpfs egL-ws "{ws / "mnt"}" && exec "{sys.executable}" -c "$0"', code],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 1000
    assert not (ws / "mnt" / "big").exists()  # it lived on the tmpfs, gone with the namespace


def test_a_missing_workspace_counts_zero(tmp_path):
    assert WorkspaceWatch(tmp_path / "absent", 1, lambda: None).scan() == 0
    assert wait_for(lambda: True)
