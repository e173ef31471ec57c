"""kill_all empties the run whatever the workload does, through each kill mechanism, on real cgroups.

The mechanism depends on the host: cgroup.kill (cgroup2, and the tracking group of a hybrid host), the v1
freezer, or repeated SIGKILL rounds. Each is forced here by handing `create` a view of this host's mounts
without the stronger ones; each must leave no process behind a fork bomb that forks as fast as it can.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from egressgate.runtimes.cgroups import read_mounts
from tests.runtimes import limits_support
from tests.runtimes.limits_support import alive, assert_pids_capped, bomb_argv, require_cgroups, wait_for

runs = limits_support.runs  # the fixture

require_cgroups()

# forks as fast as it can and retries at once when fork fails: the harshest case for a kill loop
FAST_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


def _views():
    m = read_mounts()
    views = {}
    if m.v2 is not None:
        views["cgroup.kill"] = m
    if "freezer" in m.v1 and "pids" in m.v1:
        views["v1 freezer"] = replace(m, v2=None)
    if "pids" in m.v1:
        views["SIGKILL rounds"] = replace(m, v2=None, v1={"pids": m.v1["pids"]})
    return views


VIEWS = _views()


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_kill_all_ends_a_fork_bomb_and_leaves_no_process(runs, view):
    mounts = VIEWS[view]
    limits = runs.create("kill", {"pids_max": 64}, mounts=mounts)
    if view == "cgroup.kill":
        assert any(g.version == 2 and g.has("cgroup.kill") for g in limits.groups)
    elif view == "v1 freezer":
        assert any(g.has("freezer.state") for g in limits.groups) and all(g.version == 1 for g in limits.groups)
    else:
        assert [g.path.parent.parent.name for g in limits.groups] == ["pids"]
    assert_pids_capped(limits, 64)
    proc = runs.spawn(limits, bomb_argv(FAST_BOMB))
    assert wait_for(lambda: len(limits.pids()) >= 20, timeout=10)
    time.sleep(0.3)
    members = limits.pids()
    started = time.monotonic()
    limits.kill_all()
    took = time.monotonic() - started
    assert limits.pids() == []
    proc.wait(5)
    assert wait_for(lambda: not any(alive(p) for p in members), timeout=5)
    limits.remove()
    assert limits.groups and not any(g.exists() for g in limits.groups)
    assert took < 5, took


def test_kill_all_without_any_limit_tracks_the_tree(runs):
    """No limit requested: the run still gets a tracking group, so the wall-time kill reaches every process."""
    limits = runs.create("track", {})
    assert limits.groups
    proc = runs.spawn(limits, ["/bin/sh", "-c", "sleep 1000 & sleep 1000 & wait"])
    assert wait_for(lambda: len(limits.pids()) == 3)
    limits.kill_all()
    assert limits.pids() == []
    proc.wait(5)
