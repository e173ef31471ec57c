"""`sandbox gc` reading another state dir (a second gateway on the host, or `--state-dir`) leaves a live run
of this gateway alone: the run's host-wide lock (runtimes/runlock.py) marks it live, although no record in
that state dir claims it. Without the lock the sweep took the run's veth and nft table at once (they have no
grace). The control: the same gc takes them once the run and its watchdog are SIGKILLed (the lock is gone).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from egressgate.runtimes import runlock
from tests.runtimes.harness import Gateway
from tests.runtimes.runs import SWEEP_GRACE, kill_watchdog, leftovers, netns_commands, wait_for_workload

pytestmark = pytest.mark.netns

def locked(run_id: str) -> bool:
    """Whether the run's lock file exists and is locked, without touching it (runlock.held() would remove
    an unlocked one, which is gc's job here)."""
    try:
        fd = os.open(runlock.LOCK_DIR / run_id, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


CURL = 'read go; curl -sS --noproxy "*" --max-time 10 -o /dev/null -w "%{http_code}" https://api.allowed.test/'


def gc_of_another_state_dir(gateway: Gateway, other: Path) -> subprocess.CompletedProcess[str]:
    other.mkdir(exist_ok=True)
    return subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config), "--state-dir", str(other),
                                      "--grace", str(SWEEP_GRACE)),
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_gc_of_another_state_dir_leaves_a_live_run_alone(gateway: Gateway, tmp_path: Path) -> None:
    proc = gateway.popen_run("sh", "-c", CURL, policy="rt-allow", stdin=subprocess.PIPE)
    try:
        record = wait_for_workload(gateway, proc, command="sh")
        run_id = record["run_id"]
        assert locked(run_id)
        before = leftovers(gateway)
        assert before["veths"] == [f"egh{run_id}"] and len(before["tables"]) == 1  # what the sweep would take
        gc = gc_of_another_state_dir(gateway, tmp_path / "other")
        assert gc.returncode == 0, gc.stdout + gc.stderr
        assert run_id not in gc.stdout, gc.stdout
        assert leftovers(gateway)["veths"] == before["veths"] and leftovers(gateway)["tables"] == before["tables"]
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    # the run still had its way out after the gc, and ended cleanly: nothing left, lock file included
    assert proc.returncode == 0 and out == "200", (out, err)
    assert leftovers(gateway) == {"tables": [], "veths": [], "netns": [], "cgroups": [], "records": []}
    deadline = time.monotonic() + 60  # the watchdog, the lock's other holder, exits after the run
    while locked(run_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (runlock.LOCK_DIR / run_id).exists()  # removed by the clean end, while still locked


def test_the_same_gc_takes_the_objects_of_a_run_killed_with_its_watchdog(gateway: Gateway, tmp_path: Path) -> None:
    proc = gateway.popen_run("sleep", "60", policy="rt-allow")
    record = wait_for_workload(gateway, proc)
    run_id = record["run_id"]
    kill_watchdog(record)
    assert locked(run_id)  # the run itself still holds it
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while netns_commands(run_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (runlock.LOCK_DIR / run_id).exists() and not locked(run_id)  # released, not removed
    gc = gc_of_another_state_dir(gateway, tmp_path / "other")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert f"orphan veth egh{run_id}" in gc.stdout and f"orphan nft table egressgate_{run_id}" in gc.stdout, gc.stdout
    assert not (runlock.LOCK_DIR / run_id).exists()  # the dead run's lock file went with them
    # the gateway's own gc finishes the job from the record (revocation, netns past its grace later)
    own = subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config)), capture_output=True,
                         text=True, timeout=60, check=False)
    assert own.returncode == 0, own.stdout + own.stderr
    assert leftovers(gateway) == {"tables": [], "veths": [], "netns": [], "cgroups": [], "records": []}
