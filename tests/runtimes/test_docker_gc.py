"""Cleanup of docker runs killed with SIGKILL together with their watchdog: the container outlives
`sandbox run` (Docker owns it), so `sandbox gc` must remove it from the run record; containers labelled
`egressgate.run` with no live run are swept too, anything else on the daemon stays."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from egressgate.runtimes.diskfs import mounts
from egressgate.runtimes.docker import labelled_containers
from tests.runtimes.harness import Gateway
from tests.runtimes.runs import kill_watchdog
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns


def mounted(path: Path) -> bool:
    return any(point == str(path) for point, _fstype, _source in mounts())


def _gc(gateway: Gateway, dockerd: Dockerd) -> subprocess.CompletedProcess[str]:
    """gc with its default grace: what these tests remove (recorded objects, orphan binds of the state dir,
    labelled containers on this dockerd) takes no grace, and the host-wide netns/cgroup sweep must leave a
    run another test worker is setting up alone (runs.SWEEP_GRACE)."""
    return subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config), ),
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "DOCKER_HOST": dockerd.host})


def test_sigkill_then_gc_removes_the_container(gateway: Gateway, dockerd: Dockerd) -> None:
    argv = gateway.cmd("sandbox", "run", "--config", str(gateway.config), "--policy", "rt-allow", "--runtime",
                       "docker", "--image", dockerd.busybox_image(), "--", "sleep", "60")
    before = set(labelled_containers(dockerd.host))
    proc = subprocess.Popen(argv, env={**gateway.caller_env(), "DOCKER_HOST": dockerd.host},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    started: list = []
    while time.monotonic() < deadline and not started:
        started = list((gateway.state_dir / "docker").glob("*/hold/go"))
        time.sleep(0.05)
    assert started, "the workload never started"
    run_id = started[0].parent.parent.name
    record = json.loads((gateway.state_dir / "runs" / f"{run_id}.json").read_text())
    kill_watchdog(record)  # else it removes the container itself (test_watchdog.py)
    proc.send_signal(signal.SIGKILL)
    proc.wait(20)
    proc.communicate(timeout=10)
    # positive control: the container and the record outlived `sandbox run`
    left = {n: r for n, r in labelled_containers(dockerd.host).items() if n not in before}
    assert left == {f"egressgate-{run_id}": run_id}
    record = json.loads((gateway.state_dir / "runs" / f"{run_id}.json").read_text())
    assert record["container"] == f"egressgate-{run_id}" and record["docker_host"] == dockerd.host
    # ... and so did the workspace's nosuid bind (diskfs.nosuid_bind), which the record names
    bind = gateway.state_dir / "binds" / run_id / "0"
    assert mounted(bind) and any(e.get("bind") and e["target"] == str(bind) for e in record["disk_mounts"])
    gc = _gc(gateway, dockerd)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert f"container egressgate-{run_id}" in gc.stdout
    assert run_id not in labelled_containers(dockerd.host).values()
    assert not (gateway.state_dir / "runs" / f"{run_id}.json").exists()
    assert not mounted(bind) and not bind.parent.exists()


def test_gc_unmounts_orphan_binds_of_its_state_dir_only(gateway: Gateway, tmp_path: Path) -> None:
    """A nosuid bind no record names (a lost record) is unmounted by gc's orphan pass; a bind elsewhere, or
    under a name that is not a run id, stays."""
    source = tmp_path / "src"
    source.mkdir()
    orphan = gateway.state_dir / "binds" / "0123456789" / "0"
    other = gateway.state_dir / "binds" / "not-a-run" / "0"
    for target in (orphan, other):
        target.mkdir(parents=True)
        subprocess.run(["mount", "--bind", str(source), str(target)], check=True)
    try:
        assert mounted(orphan) and mounted(other)  # positive control
        gc = subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config), ),
                            capture_output=True, text=True, timeout=120, check=False)
        assert gc.returncode == 0, gc.stdout + gc.stderr
        assert f"orphan bind {orphan}" in gc.stdout, gc.stdout
        assert not mounted(orphan) and not orphan.parent.exists()
        assert mounted(other)
    finally:
        subprocess.run(["umount", str(other)], check=False)
        subprocess.run(["umount", str(orphan)], capture_output=True, check=False)
        for path in (other, orphan):
            if path.exists():
                path.rmdir()
                path.parent.rmdir()


def test_gc_sweeps_labelled_orphans_only(gateway: Gateway, dockerd: Dockerd) -> None:
    img = dockerd.busybox_image()
    dockerd.docker("run", "-d", "--network", "none", "--name", "egD-orphan", "--label", "egressgate.run=0123456789",
                   img, "sleep", "60")
    dockerd.docker("run", "-d", "--network", "none", "--name", "egD-keep", img, "sleep", "60")
    try:
        gc = _gc(gateway, dockerd)
        assert gc.returncode == 0, gc.stdout + gc.stderr
        assert "orphan container egD-orphan" in gc.stdout
        names = dockerd.docker("ps", "-a", "--format", "{{.Names}}").stdout.split()
        assert "egD-orphan" not in names and "egD-keep" in names
    finally:
        dockerd.docker("rm", "-f", "egD-orphan", "egD-keep", check=False)
