"""An allowed relayed tunnel (tls: passthrough, network.tcp) that ends before its first byte still gets
its outcome record.

Review finding (issue 11): the tunnel's layer was chosen only when the client's first bytes arrived
(mitmproxy asks the next_layer hook on data), and the layer writes the tunnel's one outcome record. A
CONNECT that was allowed, recorded and dialed (the upstream saw a TCP connection: the connection strategy
is eager) but then closed by the client, reset, or cut by revocation before any byte had no layer, so
its allow record was never followed by an outcome: the trail could not tell a finished tunnel from a lost
record. Positive control in each case: the same tunnel with one exchange does get its outcome, and the
upstream did see the connection that the silent tunnel opened.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.support.env import refusing_port
from tests.support.gwworld import connect_tunnel, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def counting(world):
    """A TCP upstream that counts the connections it accepted (and says nothing)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        try:
            while True:
                accepted.append(srv.accept()[0])
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    world.dns.records["quiet.test"] = "127.0.0.1"
    try:
        yield srv.getsockname()[1], accepted
    finally:
        srv.close()
        for conn in accepted:
            conn.close()


@pytest.fixture(scope="module")
def dead_port():
    """A port held bound and never listening for the module: the upstream refuses the connection."""
    with refusing_port() as port:
        yield port


@pytest.fixture(scope="module")
def gw(world, counting, dead_port, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-silent")
    (tmp / "policies").mkdir()
    port, _ = counting
    doc = {"sandbox": {"name": "silent"}, "network": {
        "allow_private": ["127.0.0.1/32"],
        "https": {"allow": [{"id": "pt", "host": "quiet.test", "ports": [port], "tls": "passthrough"}]},
        "tcp": {"allow": [{"id": "raw", "host": "tcp.test", "ports": [world.tcp_port]}]}}}
    for name in ("pt-dead.test", "mitm-dead.test", "tcp-dead.test"):
        world.dns.records[name] = "127.0.0.1"
    doc["network"]["https"]["allow"] += [
        {"id": "pt-dead", "host": "pt-dead.test", "ports": [dead_port], "tls": "passthrough"},
        {"id": "mitm-dead", "host": "mitm-dead.test", "ports": [dead_port]}]
    doc["network"]["tcp"]["allow"].append({"id": "tcp-dead", "host": "tcp-dead.test", "ports": [dead_port]})
    (tmp / "policies" / "silent.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    gateway = start_gateway(world, tmp)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


def _records(gw, sandbox_id: str, operation: str) -> list[dict]:
    return [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox_id
            and r.get("egressgate.operation") == operation]


@pytest.mark.parametrize("ending", ["close", "revoke"])
def test_silent_passthrough_tunnel_gets_its_outcome(gw, counting, ending):
    port, accepted = counting
    before = len(accepted)
    sbx = gw.admit("silent")
    sock, head = connect_tunnel(gw, sbx, f"quiet.test:{port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert wait_for(lambda: len(accepted) > before, timeout=5)  # the upstream saw the tunnel's connection
    if ending == "revoke":
        assert gw.revoke(sbx.id).status_code in (200, 204)
        sock.settimeout(5)
        assert sock.recv(100) == b""
    sock.close()
    [decision] = _records(gw, sbx.id, "connect")
    assert (decision["egressgate.decision"], decision["egressgate.tls"]) == ("allow", "passthrough")
    assert wait_for(lambda: _records(gw, sbx.id, "outcome"), timeout=5), "allowed tunnel without an outcome"
    [out] = _records(gw, sbx.id, "outcome")
    assert out["egressgate.request.id"] == decision["egressgate.request.id"]
    assert (int(out["egressgate.bytes.out"]), int(out["egressgate.bytes.in"])) == (0, 0)
    assert out["egressgate.tls"] == "passthrough"
    if ending == "revoke":
        assert (out["egressgate.decision"], out["egressgate.reason"]) == ("deny", "sandbox_revoked")


@pytest.mark.parametrize("silent", [True, False], ids=["silent", "control"])
def test_tcp_relay_gets_its_outcome_with_or_without_bytes(gw, world, silent):
    sbx = gw.admit("silent")
    sock, head = connect_tunnel(gw, sbx, f"tcp.test:{world.tcp_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    if not silent:
        sock.sendall(b"ping")
        sock.settimeout(5)
        assert sock.recv(100) == b"echo:ping"
    sock.close()
    [decision] = _records(gw, sbx.id, "connect")
    assert wait_for(lambda: _records(gw, sbx.id, "outcome"), timeout=5), "allowed tunnel without an outcome"
    [out] = _records(gw, sbx.id, "outcome")
    assert out["egressgate.request.id"] == decision["egressgate.request.id"]
    assert (int(out["egressgate.bytes.out"]) == 0) == silent


@pytest.mark.parametrize("host", ["pt-dead.test", "mitm-dead.test", "tcp-dead.test"])
def test_allowed_connect_whose_upstream_is_down_gets_its_outcome(gw, dead_port, host):
    """Sibling: an allowed CONNECT whose eager upstream connection fails is answered 502 by mitmproxy,
    and no other hook sees the flow again; its allow record still gets an outcome saying why. Positive
    control: the decision was an allow (the upstream was dialed and refused the connection)."""
    sbx = gw.admit("silent")
    sock, head = connect_tunnel(gw, sbx, f"{host}:{dead_port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 502"), head
    [decision] = _records(gw, sbx.id, "connect")
    assert decision["egressgate.decision"] == "allow"
    assert wait_for(lambda: _records(gw, sbx.id, "outcome"), timeout=5), "allowed CONNECT without an outcome"
    [out] = _records(gw, sbx.id, "outcome")
    assert out["egressgate.request.id"] == decision["egressgate.request.id"]
    assert out["http.response.status_code"] in (502, "502") and out["egressgate.error"]


@pytest.fixture(scope="module")
def faulty(world, tmp_path_factory):
    """A gateway whose state store cannot write the history of sandboxes labelled fault=history
    (tests/gateway/history_fault_launcher.py: a planted store outage)."""
    tmp = tmp_path_factory.mktemp("gw-silent-faults")
    (tmp / "policies").mkdir()
    doc = {"sandbox": {"name": "silent-faults"}, "network": {
        "allow_private": ["127.0.0.1/32"],
        "https": {"allow": [{"id": "pt", "host": "api.test", "ports": [world.https_port], "tls": "passthrough"}]},
        "tcp": {"allow": [{"id": "raw", "host": "tcp.test", "ports": [world.tcp_port]}]}}}
    (tmp / "policies" / "silent-faults.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    launcher = [sys.executable, str(Path(__file__).with_name("history_fault_launcher.py"))]
    gateway = start_gateway(world, tmp, launcher=launcher)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


@pytest.mark.parametrize("target", ["api", "tcp"])
@pytest.mark.parametrize("labels", [{"fault": "history"}, {}], ids=["refused", "control"])
def test_silent_tunnel_refused_for_its_history_says_so(faulty, world, target, labels):
    """A relayed tunnel whose history cannot be written is refused (history.py); closed before its first
    byte, its one outcome still says deny/state_unavailable, never allow. Control: the same silent tunnel
    of an unlabelled sandbox has an allow outcome."""
    sbx = faulty.admit("silent-faults", labels)
    port = world.https_port if target == "api" else world.tcp_port
    sock, head = connect_tunnel(faulty, sbx, f"{target}.test:{port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    sock.close()
    assert wait_for(lambda: _records(faulty, sbx.id, "outcome"), timeout=5)
    time.sleep(0.2)
    [out] = _records(faulty, sbx.id, "outcome")
    expected = ("deny", "state_unavailable") if labels else ("allow", "rule_matched")
    assert (out["egressgate.decision"], out["egressgate.reason"]) == expected
