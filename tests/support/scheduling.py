"""How `make test` spreads the suite over pytest-xdist workers (`--dist loadgroup`).

Every test gets an `xdist_group`; a group runs on one worker, in collection order, and no two workers
ever run the same group. The groups:

* **one per test module** by default: a module's module- and session-scoped fixtures (its gateway, its
  network world, its OpenBao) are built once on the worker that runs the module, not once per worker;
* **three host groups** for every module that starts product sandboxes (`sandbox run` with any runtime,
  `mcp run`), uses the private Docker daemon, or asserts on host-global product objects. Each group runs on
  one worker, in order; the three run side by side (they were one `host-runtime` group, the suite's
  critical path). What makes that safe:

  - `host-docker`: the runtime modules that use the private dockerd (tests/support/dockerd.py, a session
    fixture: one daemon and one set of test images per worker, so all of them on one worker) — docker and
    gVisor runs, the docker gc/watchdog/identity tests;
  - `host-heavy`: the three longest modules, each on its own too long to share a group with the rest
    (weights in tests/durations.json: seconds per group in a parallel run): QEMU boots (test_microvm.py),
    the real-client matrix (test_client_matrix.py) and `compose up` (render/test_compose_up.py: it builds
    the product images in a dockerd of its own worker, the only other daemon of the run), and
    test_limits_workspace.py to even out the groups (host-netns was the longest in a parallel run);
  - `host-netns`: the rest of tests/runtimes/ (netns/bwrap runs, limits, gc) and the local MCP relay.

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
so the long groups do not start last and set the wall time; unknown groups keep their place after them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"

# (group, why, module paths relative to tests/ — a folder prefix ends with "/"); the first match wins.
# DOCKERD_MODULES: the runtime modules with a test that uses the `dockerd` fixture (assign_groups refuses a
# dockerd user outside DOCKERD_GROUPS: it would start one more daemon on yet another worker)
DOCKERD_MODULES = tuple(f"runtimes/test_{name}.py" for name in (
    "docker_adapter", "docker_disk_limits", "docker_errors", "docker_escape", "docker_gc", "docker_host",
    "docker_identity", "docker_mounts", "docker_persistence", "dockerapi", "dockerd", "gvisor_seccomp",
    "kernel_surface", "secrets_off_argv", "setid_leftover", "trust_containers", "watchdog",
    "gvisor_threads",  # on main, not yet on this branch
))
DOCKERD_GROUPS = ("host-docker", "host-heavy")
EXCLUSIVE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("host-docker", "one private dockerd (and one set of test images) per worker", DOCKERD_MODULES),
    ("host-heavy", "the longest sandbox modules: QEMU boots, the client matrix, compose up (own dockerd)", (
        "runtimes/test_microvm.py", "runtimes/test_client_matrix.py", "render/test_compose_up.py",
        "runtimes/test_limits_workspace.py", "render/test_compose_up_standalone.py",  # the latter: on main
    )),
    ("host-netns", "product sandboxes (netns, bwrap, limits, gc)", ("runtimes/", "mcp/test_local_relay.py")),
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


def assign_groups(items: list[pytest.Item], tests_root: Path, weights: dict[str, float] | None = None) -> None:
    """Mark every item with its group and reorder `items` so the heaviest groups come first (stable:
    within a group, and among groups of equal weight, collection order is kept)."""
    weights = load_weights() if weights is None else weights
    first_seen: dict[str, int] = {}
    group_by_item: dict[int, str] = {}
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(tests_root).as_posix()
        group = group_of(rel)
        if "dockerd" in getattr(item, "fixturenames", ()) and group not in DOCKERD_GROUPS:
            raise pytest.UsageError(f"{rel} uses the dockerd fixture: add it to DOCKERD_MODULES in "
                                    "tests/support/scheduling.py (group host-docker)")
        first_seen.setdefault(group, len(first_seen))
        group_by_item[id(item)] = group
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda it: (-weights.get(group_by_item[id(it)], 0.0), first_seen[group_by_item[id(it)]]))


class GroupDurations:
    """`pytest --group-durations=PATH`: seconds per group (setup + call + teardown of its tests), written as
    JSON at the end of the run, heaviest first: the weights `assign_groups` reads from tests/durations.json.
    Registered on the controller only; xdist hands it every worker's reports."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        rel = module.removeprefix("tests/")
        group = group_of(rel)
        self.seconds[group] = self.seconds.get(group, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        self.path.write_text(json.dumps({k: round(v, 1) for k, v in ordered}, indent=0) + "\n")
