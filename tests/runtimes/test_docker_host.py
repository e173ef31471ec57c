"""`runtime.docker_host` in the gateway config names the daemon `sandbox run --runtime docker` uses; it
wins over the caller's DOCKER_HOST (the operator's setting, published in gateway.json)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.networld as nw
from egressgate.config import ConfigError, load_config
from tests.networld import World
from tests.runtimes.harness import base_dir, remove
from tests.support.dockerd import Dockerd
from tests.support.launcher import EGRESSGATE, launch_in_namespace, stop_process, write_policies

pytestmark = pytest.mark.netns


def test_config_validates_docker_host() -> None:
    cfg = load_config(None, {"runtime": {"docker_host": "unix:///run/x/docker.sock"}})
    assert cfg.runtime.docker_host == "unix:///run/x/docker.sock"
    assert load_config(None).runtime.docker_host is None
    with pytest.raises(ConfigError, match="docker_host"):
        load_config(None, {"runtime": {"docker_host": "/var/run/docker.sock"}})
    for remote in ("tcp://127.0.0.1:2375", "ssh://root@127.0.0.1", "fd://"):  # the API client is unix-only
        with pytest.raises(ConfigError, match="unix socket"):
            load_config(None, {"runtime": {"docker_host": remote}})


@pytest.fixture
def gateway_with_docker_host(world: World, dockerd: Dockerd) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    base = base_dir()
    write_policies(base / "policies", {"dh": {"sandbox": {"name": "dh"}}})
    config = {"listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": "127.0.0.1:0",
                         "transparent": "127.0.0.2:0"},
              "dns": {"upstreams": [f"{nw.DNS_ADDR}:53"]}, "policy": str(base / "policies"),
              "var_dir": str(base / "var"),
              "runtime": {"state_dir": str(base / "state"), "docker_host": dockerd.host}}
    proc, _, _, stderr = launch_in_namespace(world, world.gw, base, config)  # the gateway is up
    try:
        yield base, proc
    finally:
        stop_process(proc, timeout=10)
        stderr.close()
        remove(base)


def test_configured_docker_host_wins_over_the_callers(gateway_with_docker_host: tuple, world: World,
                                                      dockerd: Dockerd) -> None:
    base, _ = gateway_with_docker_host
    published = json.loads((base / "var" / "gateway.json").read_text())
    assert published["runtime"]["docker_host"] == dockerd.host
    argv = ["nsenter", f"--net=/run/netns/{world.gw}", EGRESSGATE, "sandbox", "run", "--config",
            str(base / "gateway.yaml"), "--policy", "dh", "--runtime", "docker", "--image", dockerd.busybox_image(),
            "--", "echo", "ran"]
    wrong = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/egD/docker.sock"}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=wrong, check=False)
    assert res.returncode == 0 and res.stdout.strip() == "ran", res.stderr
