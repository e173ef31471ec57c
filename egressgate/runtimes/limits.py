"""The policy's `sandbox.resources` enforced on a process tree with cgroups (and docker flags for containers).

Rule (fail closed): every limit the policy sets is either written to the kernel, with its hit detectable
afterwards, or `create` raises LimitsUnavailable naming what is missing — a run never starts without a
limit it asked for. Limits handled elsewhere: `wall_time_seconds` (the adapter's wait() deadline, using
kill_all here to end the whole tree) and `outbound_bytes_max` (the gateway counts bytes).

Where the groups go: `<parent>/<run_id>` at the root of each hierarchy used. cgroup2 when a cgroup2 mount
offers every controller needed (pure v2 hosts); otherwise one v1 group per controller, plus a tracking group
to find and kill the whole tree — in the cgroup2 mount when there is one (hybrid hosts: cgroup.kill is
atomic), else in the v1 freezer, else in any v1 hierarchy. Only the run's own group is removed at the end;
`<parent>` stays (it is shared by concurrent runs, and removing it would race with their mkdir).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from egressgate.runtimes import cgroups
from egressgate.runtimes.base import Limit
from egressgate.runtimes.cgroups import CgroupError, Group, Mounts

__all__ = ["CFS_PERIOD_US", "LimitsUnavailable", "ResourceLimits", "docker_flags"]

CFS_PERIOD_US = 100_000  # the kernel's default period; 1 s for cpu_millis < 10 (the quota must be >= 1 ms)
ENFORCED_HERE = ("memory_mb", "pids_max", "cpu_millis")
ENFORCED_ELSEWHERE = ("wall_time_seconds", "outbound_bytes_max")
CONTROLLER = {"memory_mb": "memory", "pids_max": "pids", "cpu_millis": "cpu"}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class LimitsUnavailable(RuntimeError):
    """A limit the policy requests cannot be enforced on this host; the run must not start."""


def _wanted(resources: dict) -> dict[str, int]:
    """controller → value for the limits this module enforces. An unknown key is refused rather than
    ignored: a limit added to the policy language later must not run unenforced on an older runtime."""
    out: dict[str, int] = {}
    for key, value in resources.items():
        if key in ENFORCED_ELSEWHERE or value is None:
            continue
        if key not in ENFORCED_HERE:
            raise LimitsUnavailable(f"resources.{key} is not a limit this runtime knows how to enforce")
        if type(value) is not int or value <= 0:
            raise LimitsUnavailable(f"resources.{key} must be a positive integer, not {value!r}")
        out[CONTROLLER[key]] = value
    return out


def cfs(cpu_millis: int) -> tuple[int, int]:
    """(quota_us, period_us) giving cpu_millis thousandths of one CPU. Quota may exceed the period (more
    than one CPU); the kernel refuses quotas under 1 ms, hence the longer period for tiny shares."""
    period = CFS_PERIOD_US if cpu_millis >= 10 else 1_000_000
    return cpu_millis * period // 1000, period


def _layout(mounts: Mounts, needed: set[str]) -> list[tuple[Path, int, frozenset[str]]]:
    """[(hierarchy root, version, controllers to configure there)] or LimitsUnavailable naming the missing
    controllers. One directory per hierarchy: v1 controllers co-mounted ("cpu,cpuacct") share one group, which
    then gets the limits of all of them. A hierarchy with no controller to configure is the tracking group."""
    if mounts.v2 is not None and needed <= mounts.v2_controllers():
        return [(mounts.v2, 2, frozenset(needed))]
    missing = needed - set(mounts.v1)
    if missing:
        offer = sorted(mounts.v2_controllers())
        raise LimitsUnavailable(
            f"no cgroup hierarchy offers the {', '.join(sorted(missing))} controller "
            f"(cgroup2 at {mounts.v2}: {offer or 'none'}; v1: {sorted(mounts.v1) or 'none'}); "
            "mount it or drop that limit from the policy"
        )
    by_root: dict[Path, set[str]] = {}
    for c in sorted(needed):
        by_root.setdefault(mounts.v1[c], set()).add(c)
    out = [(root, 1, frozenset(cs)) for root, cs in by_root.items()]
    if mounts.v2 is not None:
        out.append((mounts.v2, 2, frozenset()))
    elif "freezer" in mounts.v1:
        if mounts.v1["freezer"] not in by_root:
            out.append((mounts.v1["freezer"], 1, frozenset()))
    elif not out and mounts.v1:  # any v1 hierarchy lists the tree's processes (killed by SIGKILL rounds)
        first = "pids" if "pids" in mounts.v1 else sorted(mounts.v1)[0]
        out.append((mounts.v1[first], 1, frozenset()))
    if not out:
        raise LimitsUnavailable("no cgroup hierarchy is mounted: cannot track (and kill) the workload's process tree")
    return out


class ResourceLimits:
    """The cgroups of one run. Build with `create` (new run) or `existing` (`sandbox gc`)."""

    def __init__(self, run_id: str, groups: list[Group], wanted: dict[str, int] | None = None) -> None:
        self.run_id = run_id
        self.groups = groups  # every directory created, in creation order
        self.wanted = dict(wanted or {})

    # --- creation --------------------------------------------------------------------------------

    @classmethod
    def create(cls, run_id: str, resources: dict, *, mounts: Mounts | None = None,
               parent: str = "egressgate") -> ResourceLimits:
        """Cgroups for memory (memory_mb MiB, swap off), pids (pids_max), cpu (cpu_millis as CFS quota) under
        `<parent>/<run_id>`; LimitsUnavailable (with nothing left behind) if any requested limit cannot be
        enforced or its hit could not be detected afterwards."""
        for what, name in (("run id", run_id), ("cgroup parent", parent)):
            if not NAME_RE.match(name):
                raise LimitsUnavailable(f"{what} {name!r} is not a safe cgroup name ([A-Za-z0-9][A-Za-z0-9_.-]*)")
        wanted = _wanted(resources)
        mounts = cgroups.read_mounts() if mounts is None else mounts
        layout = _layout(mounts, set(wanted))
        self = cls(run_id, [], wanted)
        try:
            for root, version, controllers in layout:
                group = self._mkdir(root, version, parent, set(controllers) if version == 2 else set())
                for controller in sorted(controllers):
                    self._configure(group, controller, wanted[controller])
        except LimitsUnavailable:
            self._cleanup_quietly()
            raise
        except (OSError, CgroupError) as e:
            self._cleanup_quietly()
            raise LimitsUnavailable(f"cannot set up cgroups for run {run_id}: {e}") from e
        return self

    def _mkdir(self, root: Path, version: int, parent: str, controllers: set[str]) -> Group:
        """Create root/parent (shared) and root/parent/run_id; on v2 enable `controllers` down the path
        (a v2 group only gets a controller its parent lists in cgroup.subtree_control)."""
        top = root / parent
        if not top.is_dir():
            with contextlib.suppress(FileExistsError):
                cgroups.make_dir(top)
        if version == 2 and controllers:
            for level in (root, top):
                on = set((level / "cgroup.subtree_control").read_text().split())
                if controllers - on:
                    Group(level, 2).write("cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(controllers - on)))
        path = top / self.run_id
        try:
            cgroups.make_dir(path)
        except FileExistsError:
            raise LimitsUnavailable(f"cgroup {path} already exists (a leftover? `egressgate sandbox gc` removes "
                                    "those of dead runs)") from None
        group = Group(path, version)
        self.groups.append(group)
        if version == 2 and controllers:
            have = set(group.read("cgroup.controllers").split())
            if controllers - have:
                raise LimitsUnavailable(f"cgroup {path} did not get controllers {sorted(controllers - have)}")
        return group

    def _require(self, group: Group, name: str, key: str | None = None) -> None:
        if not group.has(name) or (key is not None and key not in group.events(name)):
            raise LimitsUnavailable(f"{group.path / name}{f' ({key})' if key else ''} is missing: this kernel "
                                    "cannot enforce or report that limit")

    def _configure(self, g: Group, controller: str, value: int) -> None:
        """Write one limit, after checking the file that will report its hit exists (a limit whose hit we
        could not see would turn a kill into an unexplained crash)."""
        if controller == "memory":
            limit = str(value * 1024 * 1024)
            if g.version == 2:
                self._require(g, "memory.events", "oom_kill")
                g.write("memory.max", limit)
                if g.has("memory.swap.max"):
                    g.write("memory.swap.max", "0")
                elif cgroups.swap_active():
                    raise LimitsUnavailable("swap is on but this kernel has no memory.swap.max (swap accounting "
                                            "off): the memory limit could be bypassed through swap")
                if g.has("memory.oom.group"):
                    g.write("memory.oom.group", "1")  # an OOM kill takes the whole tree, not one process
            else:
                self._require(g, "memory.oom_control", "oom_kill")
                g.write("memory.limit_in_bytes", limit)
                if g.has("memory.memsw.limit_in_bytes"):
                    g.write("memory.memsw.limit_in_bytes", limit)  # memory+swap = memory: no swap
                elif cgroups.swap_active():
                    g.write("memory.swappiness", "0")  # no memsw accounting: this memcg's pages are never swapped
        elif controller == "pids":
            self._require(g, "pids.events", "max")
            g.write("pids.max", str(value))
        elif controller == "cpu":
            quota, period = cfs(value)
            if g.version == 2:
                g.write("cpu.max", f"{quota} {period}")
            else:
                g.write("cpu.cfs_period_us", str(period))
                g.write("cpu.cfs_quota_us", str(quota))
        else:  # pragma: no cover - _wanted only yields the three above
            raise LimitsUnavailable(f"unknown controller {controller}")

    @staticmethod
    def planned_paths(run_id: str, resources: dict, *, mounts: Mounts | None = None,
                      parent: str = "egressgate") -> list[str]:
        """The directories `create` would make, for the run record written BEFORE they exist (so `sandbox gc`
        finds them even if `sandbox run` is killed in the middle of `create`). Raises as `create` would."""
        if not NAME_RE.match(run_id) or not NAME_RE.match(parent):
            raise LimitsUnavailable(f"run id {run_id!r} or cgroup parent {parent!r} is not a safe cgroup name")
        mounts = cgroups.read_mounts() if mounts is None else mounts
        return [str(root / parent / run_id) for root, _, _ in _layout(mounts, set(_wanted(resources)))]

    @classmethod
    def existing(cls, run_id: str, *, mounts: Mounts | None = None, parent: str = "egressgate") -> ResourceLimits:
        """The groups a (possibly dead) run left behind, in every hierarchy: for `sandbox gc`."""
        mounts = cgroups.read_mounts() if mounts is None else mounts
        groups: list[Group] = []
        for root, version in _hierarchies(mounts):
            path = root / parent / run_id
            if path.is_dir():
                groups.append(Group(path, version))
        return cls(run_id, groups)

    @staticmethod
    def run_ids(*, mounts: Mounts | None = None, parent: str = "egressgate") -> set[str]:
        """Run ids that have a group under `parent` in any hierarchy (gc compares them with live runs)."""
        mounts = cgroups.read_mounts() if mounts is None else mounts
        out: set[str] = set()
        for root, _ in _hierarchies(mounts):
            top = root / parent
            if top.is_dir():
                out.update(p.name for p in top.iterdir() if p.is_dir())
        return out

    # --- use -------------------------------------------------------------------------------------

    def paths(self) -> list[str]:
        return [str(g.path) for g in self.groups]

    def preexec(self) -> Callable[[], None]:
        """For subprocess.Popen(preexec_fn=...): runs in the child between fork and exec and moves it into
        every group ("0" = the writing process), so the workload never runs a single instruction outside
        its limits. A failed write raises, and Popen then fails instead of starting an unlimited child."""
        targets = [os.fsencode(g.path / "cgroup.procs") for g in self.groups]

        def enter() -> None:
            for target in targets:
                fd = os.open(target, os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)

        return enter

    def add(self, pid: int) -> None:
        """Move an already started process (before it forks: children it already has stay outside)."""
        for g in self.groups:
            g.write("cgroup.procs", str(pid))

    def hit(self) -> Limit | None:
        """After the end: MEMORY if the kernel OOM-killed a process of the run (memory.events / memory.oom_control
        `oom_kill`; v1 memory.failcnt only counts reclaim attempts, not kills), else PIDS if a fork failed at
        pids.max (pids.events `max`). The caller decides what a PIDS event means for a workload that still
        exited 0 (it coped with the failed fork)."""
        oom = pids = 0
        for g in self.groups:
            if not g.exists():
                continue
            if g.has("memory.events"):
                oom += g.events("memory.events").get("oom_kill", 0)
            elif g.has("memory.oom_control"):
                oom += g.events("memory.oom_control").get("oom_kill", 0)
            if g.has("pids.events"):
                pids += g.events("pids.events").get("max", 0)
        if oom:
            return Limit.MEMORY
        if pids:
            return Limit.PIDS
        return None

    def pids(self) -> list[int]:
        return sorted({p for g in self.groups if g.exists() for p in g.pids()})

    def kill_all(self) -> None:
        """SIGKILL every process of the run, including ones forked while the kill runs (cgroups.kill_group);
        returns once the groups are empty, raises CgroupError if processes survive."""
        cgroups.kill_group(self.groups)

    def remove(self) -> None:
        """Kill what is left, then rmdir every group of the run (idempotent)."""
        if any(g.exists() and g.populated() for g in self.groups):
            self.kill_all()
        for g in reversed(self.groups):
            g.remove()

    def _cleanup_quietly(self) -> None:
        with contextlib.suppress(OSError, CgroupError):
            self.remove()


def _hierarchies(mounts: Mounts) -> list[tuple[Path, int]]:
    out: list[tuple[Path, int]] = [(mounts.v2, 2)] if mounts.v2 is not None else []
    for point in dict.fromkeys(mounts.v1.values()):
        out.append((point, 1))
    return out


def docker_flags(resources: dict) -> list[str]:
    """The same limits for `docker run`: --memory with an equal --memory-swap (no swap), --pids-limit,
    --cpus (cpu_millis / 1000; --cpu-period/--cpu-quota under 10 millis). Unknown keys are refused, as for
    cgroups. Docker itself refuses what it cannot enforce (e.g. --memory under 6 MiB): the run fails."""
    wanted = _wanted(resources)
    flags: list[str] = []
    if "memory" in wanted:
        mem = f"{wanted['memory']}m"
        flags += ["--memory", mem, "--memory-swap", mem]
    if "pids" in wanted:
        flags += ["--pids-limit", str(wanted["pids"])]
    if "cpu" in wanted:
        if wanted["cpu"] >= 10:
            flags += ["--cpus", f"{wanted['cpu'] / 1000:.3f}".rstrip("0").rstrip(".")]
        else:  # docker refuses --cpus below 0.01; the same quota over a 1 s period is accepted
            quota, period = cfs(wanted["cpu"])
            flags += ["--cpu-period", str(period), "--cpu-quota", str(quota)]
    return flags
