"""Shared by the resource-limit tests: real cgroups and real processes, under a test-only cgroup parent.

Groups go under `egL/` (not the product's `egressgate/`) so another test's `sandbox gc` sweep of
`egressgate/*` can never kill these runs' processes, and these tests never touch another run's groups.
The tests need root and a cgroup file system; outside CI they skip without them, in CI (CI=true) never.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes.cgroups import read_mounts
from egressgate.runtimes.limits import ResourceLimits
from tests.support import waiting
from tests.support.env import IN_CI

PARENT = "egL"


def cgroups_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create cgroups"
    mounts = read_mounts()
    if mounts.v2 is None and not mounts.v1:
        return "no cgroup file system mounted"
    return None


def require_cgroups() -> None:
    """Call at module level: skip outside CI when cgroups are unusable, fail loudly in CI."""
    reason = cgroups_unavailable_reason()
    if reason is not None and not IN_CI:
        pytest.skip(f"cgroup test skipped outside CI: {reason}", allow_module_level=True)


def run_id(tag: str) -> str:
    return f"egL-{tag}-{secrets.token_hex(3)}"


class Runs:
    """Creates ResourceLimits for a test and guarantees their removal (processes killed, dirs gone)."""

    def __init__(self) -> None:
        self.made: list[ResourceLimits] = []
        self.procs: list[subprocess.Popen] = []

    def create(self, tag: str, resources: dict, **kw) -> ResourceLimits:
        limits = ResourceLimits.create(run_id(tag), resources, parent=PARENT, **kw)
        self.made.append(limits)
        return limits

    def spawn(self, limits: ResourceLimits, argv: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(argv, preexec_fn=limits.preexec(), stdin=subprocess.DEVNULL, **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for limits in self.made:
            limits.remove()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        left = [p for limits in self.made for p in limits.paths() if Path(p).exists()]
        assert not left, f"cgroups left behind: {left}"


@pytest.fixture
def runs() -> Iterator[Runs]:
    r = Runs()
    try:
        yield r
    finally:
        r.close()


def alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_for(predicate, timeout: float = 10.0, step: float = 0.02) -> bool:
    """tests.support.waiting.wait_for with this folder's defaults (cgroup and process teardown is slower)."""
    return waiting.wait_for(predicate, timeout, step)


def exit_signal(proc: subprocess.Popen) -> int | None:
    rc = proc.returncode
    return -rc if rc is not None and rc < 0 else None


SIGKILL = int(signal.SIGKILL)


# --- fork bombs with a safety net that does not depend on the code under test ---------------------

BOMB_NPROC = 400  # RLIMIT_NPROC of the bomb's own uid: far above the pids limits tested, far below pid_max

_BOMB_WRAPPER = """
import os, resource, sys
uid = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NPROC, ({n}, {n}))
os.setgroups([]); os.setgid(uid); os.setuid(uid)
os.execv(sys.argv[3], [sys.argv[3], "-I", "-c", sys.argv[2]])
"""


def bomb_argv(code: str) -> list[str]:
    """argv running `code` (a fork bomb) as a fresh unprivileged uid whose process count the kernel caps at
    BOMB_NPROC: if the cgroup pids limit were missing (a regression, a mutation test), the bomb would hit
    that cap and the test would fail on its peak, instead of filling the machine's pid table."""
    import shutil
    import sys

    uid = 61000 + secrets.randbelow(4000)
    # a python the unprivileged uid may execute (the test venv's may live under a private home)
    exe = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    return [sys.executable, "-c", _BOMB_WRAPPER.format(n=BOMB_NPROC), str(uid), code, exe]


def assert_pids_capped(limits: ResourceLimits, cap: int) -> None:
    """Before a bomb starts: the pids.max the kernel holds for the run is the one asked for."""
    values = [g.read("pids.max").strip() for g in limits.groups if g.has("pids.max")]
    assert values == [str(cap)], values
