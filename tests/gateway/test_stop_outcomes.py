"""A connection still open when the gateway stops gets its outcome record in this run's audit trail.

Review finding (issue 11): a spliced passthrough tunnel (or a raw-TCP relay) writes its one outcome record
when it ends. At stop, mitmproxy's listeners went down and the audit sink closed while such a tunnel was
still open; the tunnel then ended with the process, after the sink, and its record (bytes moved, the
allow) was missing from the trail, kept only in the retry spool "for the next start". The positive
control is in the same test: the record did exist (the spool or the trail holds it), and the tunnel did
move bytes through the gateway.
"""

from __future__ import annotations

import ssl

import pytest
import yaml

from tests.support.gwworld import connect_tunnel, start_gateway
from tests.support.launcher import audit_records, stop_gateway


def _policy(tmp, world) -> None:
    (tmp / "policies").mkdir(exist_ok=True)
    doc = {"sandbox": {"name": "stopend"}, "network": {
        "allow_private": ["127.0.0.1/32"],
        "https": {"allow": [{"id": "pt-api", "host": "api.test", "ports": [world.https_port], "tls": "passthrough"}]},
        "tcp": {"allow": [{"id": "raw", "host": "tcp.test", "ports": [world.tcp_port]}]}}}
    (tmp / "policies" / "stopend.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def _open_passthrough(gw, world, sbx):
    sock, head = connect_tunnel(gw, sbx, f"api.test:{world.https_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    tls = ssl.create_default_context(cadata=world.ca.cert_pem.bytes().decode()).wrap_socket(
        sock, server_hostname="api.test")  # trusts the upstream's CA only: the tunnel is not intercepted
    tls.sendall(b"GET /echo?open=1 HTTP/1.1\r\nHost: api.test\r\n\r\n")  # keep-alive: stays open
    tls.settimeout(5)
    assert tls.recv(65536).startswith(b"HTTP/1.1 200")
    return tls


def _open_tcp(gw, world, sbx):
    sock, head = connect_tunnel(gw, sbx, f"tcp.test:{world.tcp_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    sock.sendall(b"ping")
    sock.settimeout(5)
    assert sock.recv(100) == b"echo:ping"
    return sock


@pytest.mark.parametrize("opener", [_open_passthrough, _open_tcp], ids=["passthrough", "tcp"])
def test_gateway_stop_records_the_outcome_of_an_open_tunnel(world, tmp_path, opener):
    _policy(tmp_path, world)
    gw = start_gateway(world, tmp_path)
    try:
        sbx = gw.admit("stopend")
        client = opener(gw, world, sbx)
    finally:
        stop_gateway(gw)
    client.close()
    mine = [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sbx.id]
    assert [r["egressgate.decision"] for r in mine if r["egressgate.operation"] == "connect"] == ["allow"]
    spool = gw.var / "audit-retry.jsonl"
    spooled = audit_records(spool) if spool.exists() else []
    outcomes = [r for r in mine if r["egressgate.operation"] == "outcome"]
    assert len(outcomes) == 1, f"outcome not in this run's trail; spooled for the next start: {len(spooled)}"
    assert int(outcomes[0]["egressgate.bytes.out"]) > 0 and int(outcomes[0]["egressgate.bytes.in"]) > 0
    assert spooled == []
