"""A relayed tunnel whose request history cannot be written is refused, not relayed unrecorded.

The gateway runs through history_fault_launcher.py: the state store's `record_request` fails (as in a
store outage) for sandboxes labelled `fault=history`. Such a tunnel would be invisible to every later
`after_request_to` / `unless_request_to` condition, so it must not carry a byte. Positive control: the
same tunnels for an unlabelled sandbox of the same policy reach the upstream.
"""

from __future__ import annotations

import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.gwworld import Gateway, connect_tunnel, start_gateway
from tests.support.http1 import read_all
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

LAUNCHER = [sys.executable, str(Path(__file__).with_name("history_fault_launcher.py"))]
FAULT = {"fault": "history"}


@pytest.fixture(scope="module")
def gw(world, tmp_path_factory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-pt-faults")
    (tmp / "policies").mkdir()
    (tmp / "policies" / "pt-faults.yaml").write_text(yaml.safe_dump({
        "sandbox": {"name": "pt-faults"},
        "network": {"allow_private": ["127.0.0.1/32"],
                    "https": {"allow": [{"id": "pt", "host": "api.test", "ports": [world.https_port],
                                         "tls": "passthrough"}]},
                    "tcp": {"allow": [{"id": "raw", "host": "tcp.test", "ports": [world.tcp_port]}]}},
    }))
    gateway = start_gateway(world, tmp, launcher=LAUNCHER)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


def hello(world) -> bytes:
    ctx = ssl.create_default_context(cadata=world.ca.cert_pem.bytes().decode())
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="api.test")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def outcomes(gw: Gateway, sandbox_id: str) -> list[dict]:
    return [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox_id
            and r.get("egressgate.operation") == "outcome"]


@pytest.mark.parametrize("labels", [FAULT, {}])
def test_passthrough_tunnel_without_history_is_refused(gw, world, labels):
    sbx = gw.admit("pt-faults", labels)
    snis = len(world.snis)
    sock, head = connect_tunnel(gw, sbx, f"api.test:{world.https_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    sock.sendall(hello(world))
    got = read_all(sock, 5)  # until the gateway closes, or 5 s of silence (the echo upstream never closes)
    time.sleep(0.2)
    if labels:
        assert got == b"\x15\x03\x03\x00\x02\x02\x31" and world.snis[snis:] == []
        assert wait_for(lambda: outcomes(gw, sbx.id), timeout=5)
        [out] = outcomes(gw, sbx.id)
        assert (out["egressgate.decision"], out["egressgate.reason"]) == ("deny", "state_unavailable")
    else:  # positive control: the ServerHello came back through the splice
        assert got[:1] == b"\x16" and world.snis[snis:] == ["api.test"]


@pytest.mark.parametrize("labels", [FAULT, {}])
def test_raw_tcp_tunnel_without_history_is_refused(gw, world, labels):
    sbx = gw.admit("pt-faults", labels)
    before = len(world.hits.tcp)
    sock, head = connect_tunnel(gw, sbx, f"tcp.test:{world.tcp_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    sock.sendall(b"payload")
    # the tunnel's layer is chosen as soon as the CONNECT is answered (http_layer.handle_connect_finish), so
    # a refusal may arrive in the same read as the 200's head: count what followed the head too
    got = head.split(b"\r\n\r\n", 1)[1] + read_all(sock, 2 if not labels else 5)
    sock.close()
    if labels:
        assert b"state_unavailable" in got and b"echo:" not in got
        time.sleep(0.3)
        assert not any(b"payload" in t for t in world.hits.tcp[before:])
    else:
        assert got.startswith(b"echo:payload")
