"""`sandbox run --runtime docker` fails closed with exit 120 and one readable line naming the Engine API
call and the daemon's reason (never a traceback), and leaves no container behind; a DOCKER_HOST that is
not a unix socket is refused before anything is created. The control: the same command line with a
good image and daemon runs (test_docker_host, test_docker_escape)."""

from __future__ import annotations

import re
import subprocess

import pytest

from egressgate.runtimes.docker import labelled_containers
from tests.runtimes.harness import Gateway
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns


def _run(gateway: Gateway, image: str, docker_host: str) -> subprocess.CompletedProcess[str]:
    argv = gateway.cmd("sandbox", "run", "--config", str(gateway.config), "--policy", "rt-allow", "--runtime",
                       "docker", "--image", image, "--", "echo", "ran")
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False,
                          env={**gateway.caller_env(), "DOCKER_HOST": docker_host})


def test_missing_image_is_exit_120_with_the_daemons_message(gateway: Gateway, dockerd: Dockerd) -> None:
    before = set(labelled_containers(dockerd.host))
    res = _run(gateway, "ega-no-such-image:1", dockerd.host)
    assert res.returncode == 120, res.stderr
    assert re.search(r"setup failed: \w+: docker API image inspect ega-no-such-image:1 failed \(HTTP 404\): "
                     r".*No such image: ega-no-such-image:1", res.stderr), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert set(labelled_containers(dockerd.host)) == before
    ok = _run(gateway, dockerd.busybox_image(), dockerd.host)  # positive control
    assert ok.returncode == 0 and ok.stdout.strip() == "ran", ok.stderr


@pytest.mark.parametrize("host", ["tcp://127.0.0.1:2375", "ssh://root@127.0.0.1"])
def test_non_unix_docker_host_is_refused(gateway: Gateway, host: str) -> None:
    res = _run(gateway, "busybox", host)
    assert res.returncode == 120, res.stderr
    assert f"docker host '{host}' is not supported" in res.stderr and "unix socket only" in res.stderr
    assert "Traceback" not in res.stderr
