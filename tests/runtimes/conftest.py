"""Fixtures for the runtime tests: one closed network world, and the real gateway (loopback listeners)
in its gw namespace with the runtime policies below. `sandbox run` is the real console script."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import networld as nw
import pytest
from networld import World

from runtimes.harness import Canary, Gateway, base_dir, remove

DENIED_FILE_NAME = "egN-denied.txt"


def _policy(name: str, **extra: object) -> dict:
    body: dict = {
        "sandbox": {"name": name, "workspace": {"path": "/workspace"}},
        "filesystem": {"deny": ["/etc/shadow", "/var/run/docker.sock"]},
        "network": {
            "allow_private": ["198.18.1.0/24"],
            "dns": {"allow": ["api.allowed.test"]},
            "https": {"allow": [{"id": "allowed-api", "host": "api.allowed.test"}]},
        },
    }
    for key, value in extra.items():
        section, _, field = key.partition("__")
        body.setdefault(section, {})[field] = value
    return body


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World.create(tmp_path_factory.mktemp("networld"))
    try:
        yield w
    finally:
        w.close()


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
    base = base_dir()
    denied = str(host_files / DENIED_FILE_NAME)
    policies = {
        "rt-allow": _policy("rt-allow", filesystem__deny=["/etc/shadow", "/var/run/docker.sock", denied]),
        "rt-nomask": _policy("rt-nomask"),
        "rt-commands": _policy("rt-commands", execution__commands=["python3", "true"]),
    }
    gw = Gateway.start(world, base, policies)
    try:
        yield gw
    finally:
        gw.stop()
        remove(base)


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
