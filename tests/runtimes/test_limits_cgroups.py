"""Resource limits on real cgroups with real processes (this host's hierarchies: v1, v2 or hybrid).

Each limit is shown to hold against a hostile workload (fork bomb, unbounded allocation, busy loop) and to
be reported as the right Limit, with a positive control proving the same workload is NOT stopped when the
limit is absent or generous (so the test would fail if the limit were not applied).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from egressgate.runtimes.base import Limit
from tests.runtimes import limits_support
from tests.runtimes.limits_support import (
    SIGKILL,
    alive,
    assert_pids_capped,
    bomb_argv,
    exit_signal,
    require_cgroups,
    wait_for,
)

runs = limits_support.runs  # the fixture

require_cgroups()

# every process forks forever and retries when fork fails (a shell bomb dies out: dash exits on a failed fork)
BOMB = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.05)\n"


def sample_max(limits, seconds: float) -> int:
    """Highest process count seen in the run's groups over `seconds`."""
    peak, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, len(limits.pids()))
        time.sleep(0.01)
    return peak


# --- pids ----------------------------------------------------------------------------------------

def test_fork_bomb_contained_and_reported_as_pids(runs):
    limits = runs.create("bomb", {"pids_max": 40})
    assert_pids_capped(limits, 40)
    proc = runs.spawn(limits, bomb_argv(BOMB))
    peak = sample_max(limits, 2.0)
    assert 0 < peak <= 40, peak
    assert proc.poll() is None and len(limits.pids()) > 30  # still bombing: only the limit holds it
    assert limits.hit() is Limit.PIDS
    limits.kill_all()
    assert limits.pids() == []
    proc.wait(5)
    assert exit_signal(proc) == SIGKILL
    limits.remove()
    assert not any(Path(p).exists() for p in limits.paths())


def test_positive_control_the_same_bomb_grows_past_the_limit_when_the_limit_is_higher(runs):
    """Without a low pids.max the bomb reaches far more than 40 processes (bounded at 150 for the machine's sake)."""
    limits = runs.create("bomb-ctl", {"pids_max": 150})
    assert_pids_capped(limits, 150)
    runs.spawn(limits, bomb_argv(BOMB))
    assert wait_for(lambda: len(limits.pids()) > 60, timeout=10)
    limits.kill_all()
    assert limits.pids() == []


def test_small_workload_under_the_pids_limit_succeeds_and_reports_nothing(runs):
    limits = runs.create("pids-ok", {"pids_max": 40})
    proc = runs.spawn(limits, ["/bin/sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10; do /bin/true & done; wait"])
    assert proc.wait(10) == 0
    assert limits.hit() is None


# --- memory --------------------------------------------------------------------------------------

GROW = "b=[]\nwhile True: b.append(bytearray(1 << 20))\n"
BOUNDED = "import sys\nb=[bytearray(1 << 20) for _ in range(int(sys.argv[1]))]\nprint(len(b))\n"


def test_memory_growth_is_oom_killed_and_reported_as_memory(runs):
    limits = runs.create("oom", {"memory_mb": 64})
    proc = runs.spawn(limits, [sys.executable, "-c", GROW])
    proc.wait(30)
    assert exit_signal(proc) == SIGKILL
    assert limits.hit() is Limit.MEMORY


def test_memory_limit_and_positive_controls(runs):
    """96 MiB is refused under memory_mb=64 (killed, MEMORY) and fine under memory_mb=256 and 16 MiB under 64."""
    tight = runs.create("mem-tight", {"memory_mb": 64})
    killed = runs.spawn(tight, [sys.executable, "-c", BOUNDED, "96"])
    killed.wait(30)
    assert exit_signal(killed) == SIGKILL and tight.hit() is Limit.MEMORY
    roomy = runs.create("mem-roomy", {"memory_mb": 256})
    ok = runs.spawn(roomy, [sys.executable, "-c", BOUNDED, "96"])
    assert ok.wait(30) == 0 and roomy.hit() is None
    small = runs.create("mem-small", {"memory_mb": 64})
    ok = runs.spawn(small, [sys.executable, "-c", BOUNDED, "16"])
    assert ok.wait(30) == 0 and small.hit() is None


def test_swap_is_off_for_the_group(runs):
    """memory+swap limit equal to the memory limit (v1 memsw) or memory.swap.max = 0 (v2)."""
    limits = runs.create("swap", {"memory_mb": 64})
    mem = next(g for g in limits.groups if g.has("memory.max") or g.has("memory.limit_in_bytes"))
    if mem.version == 2:
        assert mem.read("memory.swap.max").strip() == "0"
    elif mem.has("memory.memsw.limit_in_bytes"):
        assert int(mem.read("memory.memsw.limit_in_bytes")) == 64 * 1024 * 1024
    else:  # no swap accounting: only allowed when no swap is on (create() refuses otherwise)
        assert int(mem.read("memory.swappiness")) == 0 or len(Path("/proc/swaps").read_text().splitlines()) <= 1


def test_page_cache_pressure_is_not_reported_as_an_oom(runs, tmp_path):
    """Reading a file larger than the limit fills the group's page cache up to the limit and makes the kernel
    reclaim it, without killing anything: not a MEMORY hit (the usage/failcnt counters reach the limit; only
    an oom_kill event is an OOM)."""
    big = tmp_path / "big"
    with big.open("wb") as f:
        for _ in range(96):
            f.write(bytes(1 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # uncached: the reader's group is charged
    limits = runs.create("cache", {"memory_mb": 32})
    proc = runs.spawn(limits, ["/bin/cat", str(big)], stdout=subprocess.DEVNULL)
    assert proc.wait(60) == 0
    mem = next(g for g in limits.groups if g.has("memory.limit_in_bytes") or g.has("memory.max"))
    peak = mem.read("memory.max_usage_in_bytes" if mem.version == 1 else "memory.peak")
    assert int(peak) >= 0.9 * 32 * 1024 * 1024  # the limit was reached ...
    assert limits.hit() is None  # ... but nobody was killed


# --- cpu -----------------------------------------------------------------------------------------

BUSY = ("import os, time\nassert os.nice(0) == -20, os.nice(0)\nw=time.monotonic()\nc=time.process_time()\n"
        "while time.monotonic()-w < float(__import__('sys').argv[1]): pass\n"
        "print((time.process_time()-c)/(time.monotonic()-w))\n")


def _ratio(runs, tag: str, resources: dict, seconds: float = 1.5) -> tuple[float, object]:
    """CPU time / wall time of a busy loop in a group with `resources`. The loop runs at nice -20 (the tests
    run as root): on a loaded 2-core machine a nice-0 loop could get under 20 % of a CPU, and the control
    below could not beat the limited loop (seen in a full run with the host groups and a CPU hog side by
    side: 5 control samples of 12-24 %). At nice -20 its CFS weight is ~87 times a nice-0 process's, so
    other load cannot starve it, while the quota still caps it: CFS bandwidth control throttles the group
    whatever its weight."""
    limits = runs.create(tag, resources)
    argv = ["nice", "-n", "-20", sys.executable, "-c", BUSY, str(seconds)]
    proc = runs.spawn(limits, argv, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    return float(out), limits


def test_cpu_quota_throttles_a_busy_loop(runs):
    """cpu_millis=200: the loop gets at most ~20 % of one CPU (CPU time / wall time) and the kernel counts
    throttled periods. Control: the same loop under cpu_millis=2000 (two CPUs, no ceiling on this machine) is
    never throttled and gets clearly more CPU (the machine is shared by other jobs, so the control only has to
    beat the limited run by a margin, not reach 100 %). The host test groups run side by side
    (tests/support/scheduling.py), so one control sample can land in a burst where every runnable process
    gets less than 30 % of a CPU: the control takes up to 5 samples and must beat the margin in one (the
    limited loop never can, whatever the load: the quota caps every sample)."""
    limited, limits = _ratio(runs, "cpu", {"cpu_millis": 200})

    def throttled(lim) -> int:
        g = next(g for g in lim.groups if g.has("cpu.max") or g.has("cpu.cfs_quota_us"))
        return g.events("cpu.stat").get("nr_throttled", 0)

    assert limited <= 0.30, limited
    assert throttled(limits) > 0
    samples = []
    for attempt in range(5):
        free, control = _ratio(runs, f"cpu-ctl{attempt}", {"cpu_millis": 2000})
        assert throttled(control) == 0
        samples.append(free)
        if free > 1.5 * limited:
            break
    assert samples[-1] > 1.5 * limited, (samples, limited)


# --- wall time (the adapter's deadline uses kill_all on the whole tree) ---------------------------

def test_sleep_past_wall_time_is_killed_with_its_whole_tree(runs, tmp_path):
    """A workload that daemonizes (setsid, parent exits) is still in the run's cgroup: kill_all ends it too."""
    limits = runs.create("wall", {})
    pidfile = tmp_path / "daemon.pid"
    script = f"setsid /bin/sh -c 'echo $$ > {pidfile}; exec sleep 1000' & sleep 1000 & sleep 1000; wait"
    proc = runs.spawn(limits, ["/bin/sh", "-c", script])
    assert wait_for(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
    daemon = int(pidfile.read_text())
    deadline = time.monotonic() + 0.5  # what adapter.wait does at its deadline:
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None  # still running at the wall time
    members = limits.pids()
    assert daemon in members and len(members) >= 4
    limits.kill_all()
    assert limits.pids() == []
    proc.wait(5)
    assert exit_signal(proc) == SIGKILL
    assert wait_for(lambda: not alive(daemon), timeout=5)
    assert wait_for(lambda: not any(alive(p) for p in members), timeout=10)  # exits finish (test_limits_bwrap)


def test_remove_is_idempotent_and_kills_leftovers(runs):
    limits = runs.create("rm", {"memory_mb": 64, "pids_max": 20, "cpu_millis": 500})
    proc = runs.spawn(limits, ["/bin/sleep", "1000"])
    assert wait_for(lambda: proc.pid in limits.pids())
    limits.remove()  # processes left: killed first, then rmdir
    assert proc.wait(5) == -SIGKILL
    assert not any(Path(p).exists() for p in limits.paths())
    limits.remove()
    limits.kill_all()  # on removed groups: nothing to do, no error
