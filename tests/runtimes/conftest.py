"""Fixtures for the runtime tests: one closed network world, and the real gateway (loopback listeners)
in its gw namespace with the runtime policies below. `sandbox run` is the real console script."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.networld as nw
from tests.networld import World
from tests.runtimes.harness import (
    DENIED_FILE_NAME,
    KEPT_WORKSPACE,
    Canary,
    Gateway,
    base_dir,
    remove,
    running_gateway,
    runtime_policy,
    sandbox_world,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with sandbox_world(tmp_path_factory.mktemp("networld")) as w:
        yield w


@pytest.fixture(scope="module")
def host_files() -> Iterator[Path]:
    """A world-readable host file that one policy denies (the mask's positive control reads it)."""
    base = base_dir("/var/tmp")  # not under /tmp: the sandbox has its own /tmp
    (base / DENIED_FILE_NAME).write_text("host data the sandbox must not read\n")
    (base / DENIED_FILE_NAME).chmod(0o644)
    try:
        yield base
    finally:
        remove(base)


@pytest.fixture(scope="module")
def gateway(world: World, host_files: Path) -> Iterator[Gateway]:
    denied = str(host_files / DENIED_FILE_NAME)
    policies = {
        "rt-allow": runtime_policy("rt-allow", filesystem__deny=["/etc/shadow", "/var/run/docker.sock", denied],
                                   filesystem__allow=[{"path": str(host_files), "read": True}]),
        "rt-nomask": runtime_policy("rt-nomask", filesystem__allow=[{"path": str(host_files), "read": True}]),
        "rt-commands": runtime_policy("rt-commands", execution__commands=["python3", "true"]),
        "rt-mem": runtime_policy("rt-mem", sandbox__resources={"memory_mb": 64}),
        "rt-pids": runtime_policy("rt-pids", sandbox__resources={"pids_max": 32}),
        "rt-wall": runtime_policy("rt-wall", sandbox__resources={"wall_time_seconds": 2}),
        "rt-ws": runtime_policy("rt-ws", sandbox__workspace={**KEPT_WORKSPACE, "max_bytes": 1_000_000}),
    }
    with running_gateway(world, policies) as gw:
        yield gw


@pytest.fixture(scope="module")
def canaries(world: World) -> Iterator[dict[str, Canary]]:
    """Canaries for what the world has none of: DNS over TLS (TCP 853) at the world's resolver address
    and QUIC (UDP 443) at the allowed upstream's address."""
    made = {"dot": Canary(world, world.net, nw.DNS_ADDR, 853),
            "quic": Canary(world, world.net, nw.UPSTREAM, 443, udp=True)}
    try:
        yield made
    finally:
        for canary in made.values():
            canary.close()


@pytest.fixture(autouse=True)
def netns_baseline(request: pytest.FixtureRequest) -> None:
    """What `runs.leftovers` compares against: the product netns and cgroups that exist as this test starts."""
    if "gateway" in request.fixturenames:
        from tests.runtimes.runs import product_cgroups, product_netns

        gateway = request.getfixturevalue("gateway")
        gateway.netns_baseline, gateway.cgroup_baseline = product_netns(), product_cgroups()
