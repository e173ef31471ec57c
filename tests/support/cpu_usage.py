"""`pytest --cpu-report=PATH`: CPU seconds per test module, for cutting `make test`'s wall time.

The suite is CPU-bound on a 2-core machine (its workers end together), so its wall time follows the CPU it
burns, not the seconds each test waits: this is what to measure before cutting. Per test phase (setup, call,
teardown, and whatever the worker does between them), each worker records

* `self`: its own user+system CPU (`RUSAGE_SELF`: the test code, in-process servers, clients);
* `children`: the CPU of child processes it has reaped (`RUSAGE_CHILDREN`: gateways, CLI calls, redis,
  plus what the fork server of tests/support/zygote.py reports for the gateways it forked and reaped;
  OpenBao — counted when the test stops and waits for them, so a module-scoped daemon lands on the teardown
  of the module's last test, and a session-scoped one is not counted);
* `cgroup`: when the worker could move itself into a cgroup-v1 `cpuacct` group of its own (opt-in, this
  option only; root), the CPU of every process that stayed in it — also daemons nobody reaped and the
  grandchildren of a double fork. Product sandboxes that the runtime moves into their own cgroups are in
  the `cpu`/`memory`/`pids` hierarchies, not in `cpuacct`, so they stay counted; so are the containers of the
  private dockerd (its relative cgroup parent nests them under the worker's group), but not the RUN steps of a
  BuildKit build (`DOCKER_BUILDKIT=1`: BuildKit puts them in a top-level `egD<sid>` group; measure those
  apart). The cgroup figure includes background daemons of earlier
  modules on the same worker (a session dockerd), so read it next to `self + children`;
* `gateways`: how many gateways the phase started (tests/support/launcher.py counts startup lines).

The controller sums them per module (and keeps the costliest tests) and writes PATH as JSON; the terminal
summary shows the top modules. Not a gate: a measurement tool (how to run it: tests/support/README.md).
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
GROUP_PREFIX = "egressgate-test-cpu-"
KEY = "cpu_usage"


def _own_cgroup() -> Path | None:
    """Move this process into a fresh cpuacct group of its own (children inherit it); None if not possible
    (no v1 cpuacct hierarchy, not root, cgroup v2 only)."""
    group = CPUACCT / f"{GROUP_PREFIX}{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        int((group / "cpuacct.usage").read_text())
    except (OSError, ValueError):
        return None
    return group


def _leave_cgroup(group: Path) -> None:
    """Back to the root cpuacct group, and remove ours once empty (a leftover daemon keeps it: harmless)."""
    try:
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()
    except OSError:
        pass


def _gateway_starts() -> int:
    from tests.support import launcher

    return launcher.GATEWAY_STARTS


def _zygote_cpu() -> float:
    from tests.support import zygote

    return zygote.ZYGOTE_CPU


class Meter:
    """On every process that runs tests (each xdist worker, or the only process): snapshots between phases,
    the deltas attached to each phase's report (`user_properties`, which xdist sends to the controller)."""

    def __init__(self) -> None:
        self.group = _own_cgroup()
        self.last = self.snapshot()

    def snapshot(self) -> tuple[float, float, float, int]:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        cg = -1.0
        if self.group is not None:
            try:
                cg = int((self.group / "cpuacct.usage").read_text()) / 1e9
            except (OSError, ValueError):
                cg = -1.0
        forked = _zygote_cpu()  # forked gateways are the fork server's children: it reports their CPU
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime + forked, cg, _gateway_starts()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtestloop(self, session: pytest.Session):
        self.last = self.snapshot()  # collection is not any test's cost
        yield
        if self.group is not None:
            _leave_cgroup(self.group)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        now = self.snapshot()
        prev, self.last = self.last, now
        cg = now[2] - prev[2] if now[2] >= 0 and prev[2] >= 0 else None
        report.user_properties.append((KEY, [now[0] - prev[0], now[1] - prev[1], cg, now[3] - prev[3]]))


class Report:
    """On the controller: every phase's figures summed per module and per test; JSON at the end, and the top
    modules in the terminal summary."""

    SHOWN = 30

    def __init__(self, path: Path) -> None:
        self.path = path
        self.modules: dict[str, dict[str, float]] = {}
        self.tests: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        figures = next((v for k, v in report.user_properties if k == KEY), None)
        if figures is None:
            return
        own, kids, cg, starts = figures
        module = report.nodeid.split("::", 1)[0]
        m = self.modules.setdefault(
            module, {"self": 0.0, "children": 0.0, "cgroup": 0.0, "gateways": 0, "wall": 0.0, "tests": 0}
        )
        m["self"] += own
        m["children"] += kids
        m["cgroup"] += cg if cg is not None else own + kids
        m["gateways"] += starts
        m["wall"] += report.duration
        m["tests"] += report.when == "call"
        test = report.nodeid.split("@", 1)[0]
        self.tests[test] = self.tests.get(test, 0.0) + max(own + kids, cg or 0.0)

    def totals(self) -> dict[str, Any]:
        keys = ("self", "children", "cgroup", "gateways", "wall", "tests")
        return {k: round(sum(m[k] for m in self.modules.values()), 1) for k in keys}

    def pytest_sessionfinish(self) -> None:
        ordered = sorted(self.modules.items(), key=lambda kv: -kv[1]["cgroup"])
        top_tests = sorted(self.tests.items(), key=lambda kv: -kv[1])[:50]
        doc = {
            "totals": self.totals(),
            "modules": {k: {f: round(v, 2) for f, v in m.items()} for k, m in ordered},
            "tests": {k: round(v, 2) for k, v in top_tests},
        }
        self.path.write_text(json.dumps(doc, indent=1) + "\n")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.modules:
            return
        tr = terminalreporter
        tr.write_sep("=", f"CPU seconds per module, the top {self.SHOWN} (cgroup = worker's cpuacct group)")
        tr.write_line(f"{'cgroup':>8} {'self':>7} {'child':>7} {'wall':>7} {'gw':>4} {'n':>4}  module")
        for module, m in sorted(self.modules.items(), key=lambda kv: -kv[1]["cgroup"])[: self.SHOWN]:
            tr.write_line(
                f"{m['cgroup']:8.1f} {m['self']:7.1f} {m['children']:7.1f} {m['wall']:7.1f} "
                f"{int(m['gateways']):4d} {int(m['tests']):4d}  {module}"
            )
        t = self.totals()
        tr.write_line(
            f"{t['cgroup']:8.1f} {t['self']:7.1f} {t['children']:7.1f} {t['wall']:7.1f} "
            f"{int(t['gateways']):4d} {int(t['tests']):4d}  total ({self.path})"
        )


def register(config: pytest.Config, path: str | None) -> None:
    """Wire the option: a Meter where tests run, a Report where reports are collected (the controller)."""
    if not path:
        return
    worker = hasattr(config, "workerinput")
    dist = getattr(config.option, "numprocesses", None) and not worker
    if not dist:  # a worker, or a run without xdist: tests run here
        config.pluginmanager.register(Meter(), "cpu-meter")
    if not worker:
        config.pluginmanager.register(Report(Path(path)), "cpu-report")
