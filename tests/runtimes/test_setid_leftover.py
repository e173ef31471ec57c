"""Issue 20, item 5 after a SIGKILL: a `sandbox run` killed with SIGKILL never reaches its own teardown, so its
watchdog (or `sandbox gc`, when the watchdog is killed too) must strip the set-id bits the run's persistent
workspace holds, whoever owns the files, and audit them (`egressgate.run.setid_stripped` on the revocation)
as the teardown would. The files are planted from the host while the workload runs (inside, seccomp refuses
set-id modes: test_netns_fs.py, test_docker_escape.py).

Positive controls: the bits are really set before the kill, and the give-back to root that the leftover path
always did (release_workspace) leaves another owner's set-id file as it was."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from egressgate.runtimes.workload import release_workspace
from tests.runtimes.harness import Gateway, base_dir, remove
from tests.runtimes.runs import kill_watchdog, revocations
from tests.runtimes.test_watchdog import start_run, wait_running
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns
OTHER = 4242  # a host uid that is neither root, nor the run's, nor another sandbox's


def plant(ws: Path, uid: int) -> None:
    """Two set-id executables: one of another owner (the run-uid chown never touches it), one of the run."""
    for name, owner in (("planted", OTHER), ("own", uid)):
        path = ws / name
        path.write_text("#!/bin/sh\nid\n")
        os.chown(path, owner, owner)
        path.chmod(0o6755)  # after the chown (a chown clears the bits)
        assert path.stat().st_mode & 0o6000 == 0o6000  # positive control: the bits are really set


def check_stripped(gateway: Gateway, ws: Path, sid: str, ended_by: str, uid: int) -> None:
    planted, own = (ws / "planted").stat(), (ws / "own").stat()
    assert stat.S_IMODE(planted.st_mode) == 0o755 and planted.st_uid == OTHER, planted  # stripped, owner kept
    assert stat.S_IMODE(own.st_mode) == 0o755 and own.st_uid == 0, own  # stripped, given back to root
    (rev,) = revocations(gateway, sid)
    assert rev["egressgate.run.ended_by"] == ended_by, rev
    stripped = rev.get("egressgate.run.setid_stripped")
    assert stripped is not None, rev  # an OTLP array: the harness flattens scalars only
    assert sorted(v["stringValue"] for v in stripped["values"]) == ["own", "planted"], stripped
    assert uid != OTHER


def wait_record_gone(gateway: Gateway, run_id: str, timeout: float = 30) -> None:
    path = gateway.state_dir / "runs" / f"{run_id}.json"
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not path.exists(), path.read_text()


@pytest.mark.parametrize("runtime", ["netns", "docker", "gvisor"])
def test_watchdog_strips_setid_after_sigkill(gateway: Gateway, dockerd: Dockerd, runtime: str) -> None:
    ws = base_dir()
    extra = [] if runtime == "netns" else ["--runtime", runtime, "--image", dockerd.busybox_image()]
    env = {} if runtime == "netns" else {"DOCKER_HOST": dockerd.host}
    try:
        proc = start_run(gateway, ws, extra, env)
        sid, _token, record = wait_running(gateway, proc, ws)
        plant(ws, record["uid"])
        proc.send_signal(signal.SIGKILL)
        proc.wait(20)
        proc.communicate(timeout=10)
        wait_record_gone(gateway, record["run_id"])  # the watchdog, not gc: nobody runs `sandbox gc` here
        check_stripped(gateway, ws, sid, "watchdog", record["uid"])
        assert not (gateway.state_dir / "binds" / record["run_id"]).exists()  # docker's nosuid bind is gone too
    finally:
        remove(ws)


def test_gc_strips_setid_when_the_watchdog_is_gone_too(gateway: Gateway) -> None:
    ws = base_dir()
    try:
        proc = start_run(gateway, ws, [], {})
        sid, _token, record = wait_running(gateway, proc, ws)
        plant(ws, record["uid"])
        kill_watchdog(record)
        proc.send_signal(signal.SIGKILL)
        proc.wait(20)
        proc.communicate(timeout=10)
        assert (ws / "planted").stat().st_mode & 0o6000  # control: nothing stripped before gc runs
        gc = subprocess.run(
            gateway.cmd("sandbox", "gc", "--config", str(gateway.config)),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert gc.returncode == 0, gc.stdout + gc.stderr
        assert "removed set-id bits from 2 file(s)" in gc.stdout, gc.stdout
        check_stripped(gateway, ws, sid, "gc", record["uid"])
    finally:
        remove(ws)


def test_give_back_alone_keeps_another_owners_setid(tmp_path: Path) -> None:
    """Positive control of the leftover strip: the chown of the run's files to root (all the leftover path
    did before) clears the bits of the run's own files only; another owner's set-id file keeps them."""
    uid = 99990
    plant(tmp_path, uid)
    assert release_workspace(tmp_path, uid) == 1
    assert stat.S_IMODE((tmp_path / "own").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "planted").stat().st_mode) == 0o6755
