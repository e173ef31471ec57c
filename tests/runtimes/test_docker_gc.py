"""Cleanup of docker runs killed with SIGKILL together with their watchdog: the container outlives
`sandbox run` (Docker owns it), so `sandbox gc` must remove it from the run record; containers labelled
`egressgate.run` with no live run are swept too, anything else on the daemon stays."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from egressgate.runtimes.docker import labelled_containers
from tests.runtimes.harness import Gateway
from tests.runtimes.runs import kill_watchdog
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns


def _gc(gateway: Gateway, dockerd: Dockerd) -> subprocess.CompletedProcess[str]:
    return subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config), "--grace", "0"),
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
    gc = _gc(gateway, dockerd)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert f"container egressgate-{run_id}" in gc.stdout
    assert run_id not in labelled_containers(dockerd.host).values()
    assert not (gateway.state_dir / "runs" / f"{run_id}.json").exists()


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
