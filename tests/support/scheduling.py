"""How `make test` spreads the suite over pytest-xdist workers (`--dist loadgroup`).

Every test gets an `xdist_group`; a group runs on one worker, in collection order, and no two workers
ever run the same group. The groups:

* **one per test module** by default: a module's module- and session-scoped fixtures (its gateway, its
  network world, its OpenBao) are built once on the worker that runs the module, not once per worker;
* **four host groups** for every module that starts product sandboxes (`sandbox run` with any runtime,
  `mcp run`), uses the private Docker daemon, or asserts on host-global product objects. Each group runs on
  one worker, in order; they run side by side (they were one `host-runtime` group, the suite's
  critical path). What makes that safe:

  - `host-docker`: the runtime modules that use the private dockerd (tests/support/dockerd.py, a session
    fixture: one daemon and one set of test images per worker, so all of them on one worker) — docker and
    gVisor runs, the docker gc/watchdog/identity tests;
  - `host-heavy`: the three longest modules, each on its own too long to share a group with the rest
    (weights in tests/durations.json: seconds per group in a parallel run): QEMU boots (test_microvm.py),
    the real-client matrix (test_client_matrix.py) and `compose up` (render/test_compose_up.py: it builds
    the product images in a dockerd of its own worker, the only other daemon of the run);
  - `host-netns` and `host-netns-b`: the rest of tests/runtimes/ (netns/bwrap runs, limits, gc) and the
    local MCP relay, in two halves of about equal weight (one group was ~350 s of a quiet run, longer
    than any other group: the critical path). No dockerd in either. They need no exclusivity against each
    other for the same reasons they run beside host-docker and host-heavy (below): a run's host-global
    names are checked by run id, a test's gc sweeps with a grace, and all else a run takes is its gateway's.

  Product netns (`/run/netns/egressgate-<id>`) and cgroups (`egressgate/<id>`) are host-global names, so
  no test may assume it is alone on the host: "nothing left behind" checks look only at objects of the
  run ids their own gateway handed out (tests/runtimes/runids.py, runs.leftovers), and a test's `sandbox
  gc` never runs with `--grace 0` (runs.SWEEP_GRACE: the host-wide orphan sweep must not take another
  worker's run that is being set up; a test's own orphans are made older than the grace). Everything
  else a run takes is per gateway: its uid range (launcher.private_uid_range: a flock'd block per test
  process), its address pool and veths/nft tables (in its own world's gw namespace), its state dir (run
  records, loop-mounted disk images, microVM dirs). The shared caches (tests/support/images.py,
  sandbox_pylibs.py under /var/cache/egressgate-tests) are filled through a per-pid temp name and an
  atomic rename. Another checkout's test run on the same host is just one more concurrent worker.

Groups are handed out longest first (weights from tests/durations.json, written by `make test-durations`)
so the long groups do not start last and set the wall time. A group without a weight (a new module) is not
taken as free: it gets an estimate (`estimate_weights`: its test count times the seconds per test of its
folder, at least the median module of its folder), so a long new module is not handed out last either.
The run ends with the 20 slowest test phases (`--durations=20` in the Makefile) and each xdist group's wall
time and worker (`GroupWallTimes`), the longest first, with the groups whose weight was estimated marked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"

# (group, why, module paths relative to tests/ — a folder prefix ends with "/"); the first match wins.
# DOCKERD_MODULES: the runtime modules with a test that uses the `dockerd` fixture (assign_groups refuses a
# dockerd user outside DOCKERD_GROUPS: it would start one more daemon on yet another worker)
DOCKERD_MODULES = tuple(
    f"runtimes/test_{name}.py"
    for name in (
        "docker_adapter",
        "docker_disk_limits",
        "docker_errors",
        "docker_escape",
        "docker_gc",
        "docker_host",
        "docker_identity",
        "docker_mounts",
        "docker_persistence",
        "dockerapi",
        "dockerd",
        "gvisor_seccomp",
        "kernel_surface",
        "secrets_off_argv",
        "setid_leftover",
        "trust_containers",
        "watchdog",
        "gvisor_threads",  # on main, not yet on this branch
    )
)
DOCKERD_GROUPS = ("host-docker", "host-heavy")
EXCLUSIVE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("host-docker", "one private dockerd (and one set of test images) per worker", DOCKERD_MODULES),
    (
        "host-heavy",
        "the longest sandbox modules: QEMU boots, the client matrix, compose up (own dockerd)",
        (
            "runtimes/test_microvm.py",
            "runtimes/test_client_matrix.py",
            "render/test_compose_up.py",
            "render/test_compose_up_standalone.py",
        ),
    ),
    (
        "host-netns-b",
        "product sandboxes (netns, bwrap, limits), the second half of the netns runs",
        (
            "mcp/test_local_relay.py",
            *(
                f"runtimes/test_{name}.py"
                for name in (
                    "trust_default_paths",
                    "identity_runs",
                    "run_limits",
                    "run_disk_limits",
                    "netns_fs",
                    "workspace_persistent",
                    "netns_escape",
                    "truststore_units",
                    "gc_runlock",
                )
            ),
        ),
    ),
    ("host-netns", "product sandboxes (netns, bwrap, limits, gc)", ("runtimes/",)),
)


def group_of(rel_path: str) -> str:
    """The xdist group of a test module (path relative to tests/)."""
    for group, _why, prefixes in EXCLUSIVE:
        if any(rel_path == p or (p.endswith(("/", "_")) and rel_path.startswith(p)) for p in prefixes):
            return group
    return rel_path


def load_weights(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def folder_of(group: str) -> str:
    """The folder a module group belongs to ("" for top-level modules); the host groups have none."""
    return group.rpartition("/")[0] if group.endswith(".py") else f"<{group}>"


def estimate_weights(counts: dict[str, int], weights: dict[str, float]) -> dict[str, float]:
    """A weight for every group in `counts` (group -> its number of collected tests): the measured one from
    `weights`, else an estimate — the group's test count times the pooled seconds per test of the measured
    modules of its folder, and at least the median measured module of that folder (a one-test module can
    take 40 s: it must not be taken as nearly free) and at most its longest (a module of 90 cheap
    parametrized cases is not ten times its folder's average); a folder with no measured module uses the
    suite's figures. Pure: the scheduler's order is a function of these numbers and the collection order."""
    known = {g: w for g, w in weights.items() if g in counts and g.endswith(".py")}
    by_folder: dict[str, list[str]] = {}
    for g in known:
        by_folder.setdefault(folder_of(g), []).append(g)

    def figures(groups: list[str]) -> tuple[float, float, float]:
        tests = sum(counts[g] for g in groups)
        rate = sum(known[g] for g in groups) / tests if tests else 0.0
        ordered = sorted(known[g] for g in groups)
        median = ordered[len(ordered) // 2] if ordered else 0.0
        return rate, median, ordered[-1] if ordered else 0.0

    suite = figures(list(known))
    out: dict[str, float] = {}
    for group, n in counts.items():
        if group in weights:
            out[group] = weights[group]
            continue
        folder = by_folder.get(folder_of(group))
        rate, median, longest = figures(folder) if folder else suite
        out[group] = round(min(max(n * rate, median), longest), 1)
    return out


def assign_groups(items: list[pytest.Item], tests_root: Path, weights: dict[str, float] | None = None) -> None:
    """Mark every item with its group and reorder `items` so the heaviest groups come first (stable:
    within a group, and among groups of equal weight, collection order is kept). Groups without a measured
    weight are ordered by their estimate (`estimate_weights`)."""
    weights = load_weights() if weights is None else weights
    first_seen: dict[str, int] = {}
    counts: dict[str, int] = {}
    group_by_item: dict[int, str] = {}
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(tests_root).as_posix()
        group = group_of(rel)
        if "dockerd" in getattr(item, "fixturenames", ()) and group not in DOCKERD_GROUPS:
            raise pytest.UsageError(
                f"{rel} uses the dockerd fixture: add it to DOCKERD_MODULES in "
                "tests/support/scheduling.py (group host-docker)"
            )
        first_seen.setdefault(group, len(first_seen))
        counts[group] = counts.get(group, 0) + 1
        group_by_item[id(item)] = group
        item.add_marker(pytest.mark.xdist_group(group))
    estimated = estimate_weights(counts, weights)
    items.sort(key=lambda it: (-estimated[group_by_item[id(it)]], first_seen[group_by_item[id(it)]]))


def module_group(nodeid: str) -> str:
    """The group of a report's test (xdist appends "@group" to node ids; the module path decides)."""
    return group_of(nodeid.split("::", 1)[0].removeprefix("tests/"))


class GroupDurations:
    """`pytest --group-durations=PATH`: seconds per group (setup + call + teardown of its tests), written as
    JSON at the end of the run, heaviest first: the weights `assign_groups` reads from tests/durations.json.
    The groups this run measured replace their old weights; the others are kept (a partial run refreshes
    only what it ran), except those whose module is gone. Registered on the controller only; xdist hands it
    every worker's reports."""

    def __init__(self, path: Path, tests_root: Path) -> None:
        self.path = path
        self.tests_root = tests_root
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        group = module_group(report.nodeid)
        self.seconds[group] = self.seconds.get(group, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        hosts = {group for group, _why, _prefixes in EXCLUSIVE}
        kept = {g: w for g, w in load_weights(self.path).items() if g in hosts or (self.tests_root / g).is_file()}
        merged = kept | {k: round(v, 1) for k, v in self.seconds.items()}
        ordered = sorted(merged.items(), key=lambda kv: -kv[1])
        self.path.write_text(json.dumps(dict(ordered), indent=0) + "\n")


class GroupWallTimes:
    """At the end of a parallel run: each xdist group's wall time (first test's start to last test's end),
    its worker and its summed test time, the longest first — the critical path at a glance (which group
    ended last, and whether it started late). Groups without a weight in tests/durations.json are marked:
    their place in the order was an estimate. Registered on the controller only."""

    SHOWN = 25

    def __init__(self) -> None:
        self.span: dict[str, list[float]] = {}  # group -> [start, stop, summed seconds]
        self.worker: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = getattr(report, "node", None)  # set by xdist on the controller
        start, stop = getattr(report, "start", 0.0), getattr(report, "stop", 0.0)
        if node is None or not start:
            return
        group = module_group(report.nodeid)
        span = self.span.setdefault(group, [start, stop, 0.0])
        span[0], span[1], span[2] = min(span[0], start), max(span[1], stop), span[2] + report.duration
        self.worker[group] = node.gateway.id

    @pytest.hookimpl(tryfirst=True)  # before the slowest durations, which stay the last table of the run
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.span:
            return
        t0 = min(s[0] for s in self.span.values())
        weights = load_weights()
        tr = terminalreporter
        tr.write_sep("=", f"xdist groups: wall time, the longest {self.SHOWN} (s from the first test's start)")
        ordered = sorted(self.span.items(), key=lambda kv: -(kv[1][1] - kv[1][0]))
        for group, (start, stop, busy) in ordered[: self.SHOWN]:
            mark = "" if group in weights else "  (no weight in durations.json: estimated)"
            tr.write_line(
                f"{stop - start:7.1f}s wall {busy:7.1f}s tests  {start - t0:6.1f}-{stop - t0:6.1f}  "
                f"{self.worker[group]:<5} {group}{mark}"
            )
        per_worker: dict[str, float] = {}
        for group, (_start, stop, _busy) in self.span.items():
            per_worker[self.worker[group]] = max(per_worker.get(self.worker[group], 0.0), stop - t0)
        last = ", ".join(f"{w} {t:.0f}s" for w, t in sorted(per_worker.items()))
        try:  # the machine's load with the figures: a wall time means little without it
            load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        except OSError:
            load = "?"
        tr.write_line(f"load average at the end (1/5/15 min): {load}")
        unweighted = sorted(g for g in self.span if g not in weights)
        tr.write_line(
            f"last test end per worker: {last}; {len(unweighted)} groups without a weight"
            + (
                f" ({', '.join(unweighted[:8])}{', ...' if len(unweighted) > 8 else ''}):"
                " `make test-durations` records them"
                if unweighted
                else ""
            )
        )
