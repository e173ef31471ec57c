"""A raw-TCP tunnel refused because its request history could not be written is audited as refused.

The gateway runs through history_fault_launcher.py: `record_request` fails (a store outage) for
sandboxes labelled `fault=history`. history.py then refuses the relay (`state_unavailable`), and the
client reads the deny contract; before this test, the only record of that request id was the decision
record saying `allow`, so the audit trail claimed a relay that never happened. Every refusal must be in
the trail: an outcome record under the request id of the deny body, decision `deny`, reason
`state_unavailable`, no bytes. Both explicit-proxy raw-TCP paths: a CONNECT allowed only by a
`network.tcp` rule (the relay starts at once) and a CONNECT allowed by an https rule whose bytes are not
TLS/HTTP (layers/next_layer.py's in-tunnel raw-TCP decision). Positive control: the same tunnels of an unlabelled
sandbox reach the upstream, and their outcome record says `allow` with the bytes.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.gwworld import Gateway, connect_tunnel, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

LAUNCHER = [sys.executable, str(Path(__file__).with_name("history_fault_launcher.py"))]
FAULT = {"fault": "history"}


@pytest.fixture(scope="module")
def gw(world, tmp_path_factory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-history-audit")
    (tmp / "policies").mkdir()
    port = world.tcp_port
    (tmp / "policies" / "history-audit.yaml").write_text(yaml.safe_dump({
        "sandbox": {"name": "history-audit"},
        "network": {"allow_private": ["127.0.0.1/32"],
                    # open.test: the https rule allows the CONNECT (intercepted), the tcp rule its raw bytes
                    "https": {"allow": [{"id": "open-https", "host": "open.test", "ports": [port]}]},
                    "tcp": {"allow": [{"id": "raw", "host": "tcp.test", "ports": [port]},
                                      {"id": "open-raw", "host": "open.test", "ports": [port]}]}},
    }))
    gateway = start_gateway(world, tmp, launcher=LAUNCHER)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


def read_all(sock: socket.socket, timeout: float) -> bytes:
    """Until the gateway closes, or `timeout` of silence (the echo upstream never closes by itself)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


def records(gw: Gateway, sandbox_id: str, operation: str) -> list[dict]:
    return [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox_id
            and r.get("egressgate.operation") == operation]


@pytest.mark.parametrize("host", ["tcp.test", "open.test"])
@pytest.mark.parametrize("labels", [FAULT, {}])
def test_raw_tcp_refused_for_its_history_is_audited(gw, world, host, labels):
    sbx = gw.admit("history-audit", labels)
    before = len(world.hits.tcp)
    sock, head = connect_tunnel(gw, sbx, f"{host}:{world.tcp_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    with sock:
        sock.sendall(b"\x00raw payload")
        got = read_all(sock, 5 if labels else 2)
    if not labels:  # positive control: relayed, and the outcome says so
        assert got == b"echo:\x00raw payload"
        assert wait_for(lambda: records(gw, sbx.id, "outcome"), timeout=5)
        [out] = records(gw, sbx.id, "outcome")
        assert out["egressgate.decision"] == "allow" and int(out["egressgate.bytes.out"]) == 12
        return
    assert b"state_unavailable" in got and b"echo:" not in got, got
    body = json.loads(got.split(b"\r\n\r\n", 1)[1])
    assert (body["error"], body["reason"]) == ("egress_denied", "state_unavailable")
    time.sleep(0.3)
    assert not any(b"raw payload" in t for t in world.hits.tcp[before:])  # nothing went upstream
    # the refusal is in the trail, under the id the client was given
    assert wait_for(lambda: records(gw, sbx.id, "outcome"), timeout=5), "the refusal was not audited"
    [out] = records(gw, sbx.id, "outcome")
    assert out["egressgate.request.id"] == body["request_id"]
    assert (out["egressgate.decision"], out["egressgate.reason"]) == ("deny", "state_unavailable")
    assert int(out.get("egressgate.bytes.out", 0)) == 0 and int(out.get("egressgate.bytes.in", 0)) == 0
    assert out["server.address"] == host
    # and it follows the decision record of the same id (the allow the history failure overturned)
    assert [r["egressgate.request.id"] for r in records(gw, sbx.id, "connect")].count(body["request_id"]) == 1
