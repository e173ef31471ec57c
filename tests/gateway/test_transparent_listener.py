"""The transparent listener's place in the gateway (its traffic is tested end to end, with a real DNAT,
in tests/escape/test_transparent.py): its bound address is published in the startup line and
`var_dir/gateway.json` (where runtimes find it), it is one of the gateway's own listeners (the
explicit proxy refuses to connect to it, like to itself), and a listener that cannot bind stops the
start instead of leaving runtimes DNATing sandboxes to nothing."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import yaml

from tests.support.gwworld import connect_tunnel, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for


def transparent_of(gw) -> tuple[str, int]:
    info = json.loads((gw.var / "gateway.json").read_text())
    host, _, port = info["transparent"].rpartition(":")
    return host, int(port)


def test_transparent_address_published(gateway):
    host, port = transparent_of(gateway)
    assert host == "127.0.0.2" and port > 0
    with socket.create_connection((host, port), timeout=5):
        pass  # it listens


def test_explicit_proxy_refuses_the_transparent_listener(gateway):
    """A policy that (wrongly) allows the transparent listener's address cannot reach it through the
    explicit proxy (self_connection); control: the same policy's other rule is allowed."""
    host, port = transparent_of(gateway)
    doc = {"sandbox": {"name": "gw-self-transparent"}, "network": {
        "allow_private": ["127.0.0.0/8"],
        "https": {"allow": [{"id": "self", "host": host, "ports": [port]},
                            {"id": "api", "host": "api.test", "ports": [gateway.world.https_port]}]}}}
    path = gateway.policy_dir / "gw-self-transparent.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        def admitted():
            r = httpx.post(f"http://{gateway.admin}/v1/sandboxes", json={"policy": "gw-self-transparent"},
                           headers={"Authorization": f"Bearer {gateway.token}"}, trust_env=False)
            return r.status_code == 201
        assert wait_for(admitted, timeout=10)
        sbx = gateway.admit("gw-self-transparent")
        sock, head = connect_tunnel(gateway, sbx, f"api.test:{gateway.world.https_port}")
        sock.close()
        assert head.startswith(b"HTTP/1.1 200"), head
        sock, head = connect_tunnel(gateway, sbx, f"{host}:{port}")
        sock.close()
        assert head.startswith(b"HTTP/1.1 403") and b"self_connection" in head, head
    finally:
        path.unlink()
        time.sleep(0)


def test_transparent_off(world, tmp_path):
    gw = start_gateway(world, tmp_path, {"listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0",
                                                    "dns": None, "transparent": None}})
    try:
        assert "transparent" not in json.loads((gw.var / "gateway.json").read_text())
    finally:
        stop_gateway(gw)


def test_start_refused_when_the_transparent_listener_cannot_bind(world, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.2", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="gateway did not start"):
            start_gateway(world, tmp_path, {"listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0",
                                                       "dns": None, "transparent": f"127.0.0.2:{port}"}})
        assert "transparent" in (tmp_path / "gateway.stderr").read_text()
    finally:
        busy.close()
