"""The test scheduler's weights (tests/support/scheduling.py): a module without a measured weight is
estimated, never taken as free (weight 0 handed it out last, where a long new module set the wall time),
and `--group-durations` refreshes the weights it measured without dropping the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.scheduling import GroupDurations, estimate_weights

TESTS_ROOT = Path(__file__).resolve().parent

MEASURED = {"gateway/test_a.py": 40.0, "gateway/test_b.py": 10.0, "gateway/test_c.py": 4.0, "policy/test_p.py": 2.0}
COUNTS = {"gateway/test_a.py": 10, "gateway/test_b.py": 5, "gateway/test_c.py": 5, "policy/test_p.py": 20}


def test_measured_weights_are_used_as_they_are() -> None:
    assert estimate_weights(COUNTS, MEASURED) == MEASURED


def test_a_new_module_gets_its_folders_seconds_per_test() -> None:
    # gateway: 54 s over 20 tests = 2.7 s per test; 8 tests -> 21.6 s (between the median 10 and the longest 40)
    est = estimate_weights(COUNTS | {"gateway/test_new.py": 8}, MEASURED)
    assert est["gateway/test_new.py"] == 21.6
    # positive control: measured, the same module keeps its (small) measured weight
    assert (
        estimate_weights(COUNTS | {"gateway/test_new.py": 8}, MEASURED | {"gateway/test_new.py": 0.5})[
            "gateway/test_new.py"
        ]
        == 0.5
    )


def test_a_one_test_module_is_not_taken_as_nearly_free() -> None:
    est = estimate_weights(COUNTS | {"gateway/test_one.py": 1}, MEASURED)
    assert est["gateway/test_one.py"] == 10.0  # the folder's median module, not 2.7 s
    ordered = sorted(est, key=lambda g: -est[g])
    assert ordered.index("gateway/test_one.py") < ordered.index("gateway/test_c.py")


def test_many_cheap_cases_are_capped_at_the_folders_longest_module() -> None:
    est = estimate_weights(COUNTS | {"gateway/test_param.py": 90}, MEASURED)
    assert est["gateway/test_param.py"] == 40.0  # not 90 * 2.7 s


def test_a_folder_without_measured_modules_uses_the_suites_figures() -> None:
    est = estimate_weights(COUNTS | {"workspaces/test_w.py": 3}, MEASURED)
    # suite: 56 s over 40 tests = 1.4 s per test; 3 tests = 4.2 s < the median module (10 s)
    assert est["workspaces/test_w.py"] == 10.0
    assert all(w > 0 for w in est.values())


def report(nodeid: str, duration: float, when: str = "call") -> pytest.TestReport:
    return pytest.TestReport(nodeid, (nodeid, 0, "t"), {}, "passed", None, when, duration=duration)


def test_group_durations_refresh_what_ran_and_keep_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "durations.json"
    path.write_text(
        json.dumps(
            {"test_config.py": 18.0, "test_scheduling.py": 99.0, "host-netns": 196.0, "gone/test_removed.py": 5.0}
        )
    )
    plugin = GroupDurations(path, TESTS_ROOT)
    plugin.pytest_runtest_logreport(report("tests/test_scheduling.py::test_x@test_scheduling.py", 1.25))
    plugin.pytest_runtest_logreport(report("tests/test_scheduling.py::test_x@test_scheduling.py", 0.5, "setup"))
    plugin.pytest_runtest_logreport(report("tests/runtimes/test_gc.py::test_y@host-netns", 30.0))
    plugin.pytest_sessionfinish()
    weights = json.loads(path.read_text())
    # measured: replaced (the host group by this run's figure), in descending order; kept: test_config.py;
    # dropped: a module that no longer exists
    assert weights == {"host-netns": 30.0, "test_config.py": 18.0, "test_scheduling.py": 1.8}
    assert list(weights) == ["host-netns", "test_config.py", "test_scheduling.py"]


def test_every_runtime_module_is_in_a_host_group_and_every_listed_module_exists() -> None:
    """tests/runtimes/ starts product sandboxes: none of its modules may fall into a module group of its
    own; and a host group's module list names files that exist (a renamed module would silently move)."""
    from tests.support.scheduling import EXCLUSIVE, group_of

    hosts = {group for group, _why, _prefixes in EXCLUSIVE}
    modules = sorted(p.relative_to(TESTS_ROOT).as_posix() for p in (TESTS_ROOT / "runtimes").glob("test_*.py"))
    assert modules and {group_of(m) for m in modules} <= hosts
    assert {group_of(m) for m in modules} >= {"host-netns", "host-netns-b", "host-docker", "host-heavy"}
    listed = [p for _group, _why, prefixes in EXCLUSIVE for p in prefixes if p.endswith(".py")]
    assert [p for p in listed if not (TESTS_ROOT / p).is_file()] == []
