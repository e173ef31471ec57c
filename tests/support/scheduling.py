"""How `make test` spreads the suite over pytest-xdist workers (`--dist loadgroup`).

Every test gets an `xdist_group`; a group runs on one worker, in collection order, and no two workers
ever run the same group. The groups:

* **one per test module** by default: a module's module- and session-scoped fixtures (its gateway, its
  network world, its OpenBao) are built once on the worker that runs the module, not once per worker;
* **`host-runtime`** for every module that starts product sandboxes (`sandbox run` with any runtime, `mcp
  run`), uses the private Docker daemon, or asserts on host-global product objects. Sandboxes' network
  namespaces (`/run/netns/egressgate-<id>`) and cgroups (`egressgate/<id>`) are host-global names: `sandbox
  gc --grace 0` in one test sweeps another test's half-built run, and "nothing left behind" checks list
  them host-wide (a netns of a run on another worker failed them). One worker runs them one after another,
  as the whole suite used to, with one dockerd and one set of test images for the run.

Groups are handed out longest first (weights from tests/durations.json, written by `make test-durations`)
so the long groups do not start last and set the wall time; unknown groups keep their place after them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"

# (group, why, module paths relative to tests/ — a folder prefix ends with "/")
EXCLUSIVE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("host-runtime", "product netns/cgroups are host-global names; one dockerd per run", (
        "runtimes/", "mcp/test_local_relay.py", "render/test_compose_up.py", "render/test_compose_up_standalone.py",
    )),
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
