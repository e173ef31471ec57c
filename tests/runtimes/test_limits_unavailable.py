"""Fail closed: a limit that cannot be enforced stops the run before it starts, leaving nothing behind.

Real cgroups where the host can produce the failure (a hierarchy hidden from `create`, a value the kernel
rejects, a leftover group, a hook whose group vanished); the positive controls show the same calls work
when the limit is enforceable.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from egressgate.runtimes.cgroups import Mounts, read_mounts
from egressgate.runtimes.limits import LimitsUnavailable, ResourceLimits, docker_flags
from tests.runtimes import limits_support
from tests.runtimes.limits_support import PARENT, require_cgroups, run_id

runs = limits_support.runs  # the fixture

require_cgroups()
MOUNTS = read_mounts()


def dirs_named(rid: str) -> list[Path]:
    roots = ([MOUNTS.v2] if MOUNTS.v2 else []) + list(dict.fromkeys(MOUNTS.v1.values()))
    return [r / PARENT / rid for r in roots if (r / PARENT / rid).exists()]


@pytest.mark.skipif("memory" not in MOUNTS.v1, reason="needs a v1 memory hierarchy (hybrid/v1 host)")
def test_missing_pids_controller_is_refused_and_nothing_is_created():
    only_memory = Mounts(v2=None, v1={"memory": MOUNTS.v1["memory"]})
    rid = run_id("nopids")
    with pytest.raises(LimitsUnavailable, match="pids controller") as e:
        ResourceLimits.create(rid, {"memory_mb": 64, "pids_max": 10}, mounts=only_memory, parent=PARENT)
    assert "drop that limit" in str(e.value)
    assert dirs_named(rid) == []
    # positive control: the limit the view can enforce is accepted
    ok = ResourceLimits.create(rid, {"memory_mb": 64}, mounts=only_memory, parent=PARENT)
    assert len(ok.groups) == 1
    ok.remove()
    assert dirs_named(rid) == []


def test_no_cgroup_hierarchy_at_all_is_refused():
    with pytest.raises(LimitsUnavailable, match="no cgroup hierarchy"):
        ResourceLimits.create(run_id("none"), {}, mounts=Mounts(), parent=PARENT)


def test_a_value_the_kernel_rejects_undoes_the_groups_already_made(runs):
    """pids.max beyond PID_MAX_LIMIT: EINVAL from the kernel after the cpu and memory groups were made and
    configured; every one of them is removed."""
    rid = run_id("einval")
    with pytest.raises(LimitsUnavailable, match="cannot set up cgroups") as e:
        ResourceLimits.create(rid, {"cpu_millis": 500, "memory_mb": 64, "pids_max": 10**9}, parent=PARENT)
    assert "pids.max" in str(e.value) or "Invalid argument" in str(e.value)
    assert dirs_named(rid) == []
    runs.create("einval-ctl", {"cpu_millis": 500, "memory_mb": 64, "pids_max": 4096})  # positive control


@pytest.mark.parametrize(("resources", "words"), [
    ({"gpu_count": 1}, "gpu_count is not a limit"),
    ({"memory_mb": "64"}, "positive integer"),
    ({"pids_max": 0}, "positive integer"),
    ({"cpu_millis": True}, "positive integer"),
])
def test_unknown_or_malformed_limits_are_refused(resources, words):
    with pytest.raises(LimitsUnavailable, match=words):
        ResourceLimits.create(run_id("bad"), resources, parent=PARENT)
    with pytest.raises(LimitsUnavailable, match=words):
        docker_flags(resources)


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "x" * 65])
def test_unsafe_run_ids_are_refused(name):
    with pytest.raises(LimitsUnavailable, match="not a safe cgroup name"):
        ResourceLimits.create(name, {}, parent=PARENT)


def test_limits_enforced_elsewhere_are_accepted_without_a_controller(runs):
    limits = runs.create("elsewhere", {"wall_time_seconds": 5, "outbound_bytes_max": 1000, "memory_mb": None})
    assert limits.wanted == {}
    assert limits.groups  # still tracked, for the wall-time kill


def test_a_leftover_group_with_the_same_run_id_is_refused_and_kept(runs):
    first = runs.create("dup", {"pids_max": 10})
    with pytest.raises(LimitsUnavailable, match="already exists"):
        ResourceLimits.create(first.run_id, {"pids_max": 10}, parent=PARENT)
    assert all(g.exists() for g in first.groups)  # the refusal did not remove the other run's groups


def test_a_hook_whose_groups_vanished_fails_the_start(runs, tmp_path):
    """preexec raises in the child: Popen fails and the command never runs (no unlimited workload)."""
    limits = runs.create("gone", {"pids_max": 10})
    hook = limits.preexec()
    limits.remove()
    marker = tmp_path / "ran"
    with pytest.raises(subprocess.SubprocessError):
        subprocess.Popen(["/bin/sh", "-c", f"touch {marker}"], preexec_fn=hook)
    assert not marker.exists()
    # positive control: the same command with a live group runs
    live = runs.create("live", {"pids_max": 10})
    assert subprocess.Popen(["/bin/sh", "-c", f"touch {marker}"], preexec_fn=live.preexec()).wait(10) == 0
    assert marker.exists()


def test_gc_view_finds_and_removes_a_dead_runs_groups(runs):
    """`existing`/`run_ids` rebuild a run's groups from the hierarchies alone (its owner was SIGKILLed)."""
    limits = runs.create("gc", {"memory_mb": 64, "pids_max": 10})
    proc = runs.spawn(limits, ["/bin/sleep", "1000"])
    assert limits.run_id in ResourceLimits.run_ids(parent=PARENT)
    found = ResourceLimits.existing(limits.run_id, parent=PARENT)
    assert sorted(found.paths()) == sorted(limits.paths())
    assert proc.pid in found.pids()
    found.remove()
    assert proc.wait(5) < 0
    assert limits.run_id not in ResourceLimits.run_ids(parent=PARENT)


def test_docker_flags():
    assert docker_flags({"memory_mb": 256, "pids_max": 64, "cpu_millis": 1500, "wall_time_seconds": 9}) == [
        "--memory", "256m", "--memory-swap", "256m", "--pids-limit", "64", "--cpus", "1.5"]
    assert docker_flags({"cpu_millis": 250}) == ["--cpus", "0.25"]
    assert docker_flags({"cpu_millis": 10}) == ["--cpus", "0.01"]
    assert docker_flags({"cpu_millis": 5}) == ["--cpu-period", "1000000", "--cpu-quota", "5000"]
    assert docker_flags({}) == []


def test_the_test_view_helpers_do_not_hide_a_missing_v2(runs):
    """Sanity of the views the kill tests use: replacing v2 by None really leaves only v1 groups."""
    if not MOUNTS.v1:
        pytest.skip("pure cgroup2 host")
    limits = runs.create("views", {}, mounts=replace(MOUNTS, v2=None))
    assert all(g.version == 1 for g in limits.groups)
