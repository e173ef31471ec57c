"""One request id per request, from the deny body to the audit trail.

Every denial a sandbox can meet is driven for real against a running gateway; the test reads the
request id from the body the client got (and the X-Egressgate-Request-Id header when there is one) and runs
`egressgate audit find --request-id ID` on the audit file, as an operator answering "why was I denied?"
would: it must print that denial's decision record. Raw-TCP outcome records must share their decision's
id. Identity denials must record the target that was asked for (never the credentials that were sent).
"""

from __future__ import annotations

import base64
import json
import socket
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support import cli
from tests.support.gwworld import connect_tunnel, raw_bytes_in_tunnel, start_gateway, tls_wrap
from tests.support.http1 import read_reply
from tests.support.launcher import EGRESSGATE, flatten_otlp, stop_gateway
from tests.support.waiting import wait_for

LAUNCHER = [sys.executable, str(Path(__file__).with_name("fault_launcher.py"))]


def attrs(line: str) -> dict:
    return flatten_otlp(json.loads(line))


def audit_find(gw, request_id: str) -> list[dict]:
    """`egressgate audit find --request-id` over the gateway's audit file(s), parsed."""
    files = sorted(str(p) for p in gw.var.glob("audit*.jsonl"))
    res = cli.run([EGRESSGATE, "audit", "find", "--request-id", request_id, *files], timeout=30)
    return [attrs(line) for line in res.stdout.splitlines() if line.strip()]


def decision_of(gw, request_id: str, operation: str | None = None) -> dict:
    """The decision record `audit find` prints for this id (waits for write-behind records)."""
    found: list[dict] = []

    def has_decision() -> bool:
        found[:] = [r for r in audit_find(gw, request_id) if r.get("egressgate.operation") != "outcome"]
        return bool(found)

    assert wait_for(has_decision, timeout=5), f"audit find --request-id {request_id} found no decision record"
    assert len(found) == 1, found
    assert found[0]["egressgate.request.id"] == request_id
    if operation is not None:
        assert found[0]["egressgate.operation"] == operation, found[0]
    return found[0]


def body_id(body: bytes, headers: dict | None = None) -> str:
    data = json.loads(body)
    assert data["error"] == "egress_denied" and data["request_id"], data
    if headers is not None:  # the header and the body name the same request
        assert headers["x-egressgate-request-id"] == data["request_id"]
    return data["request_id"]


def basic(user: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def raw_proxy_request(gw, data: bytes) -> tuple[int, dict, bytes]:
    with socket.create_connection(gw.proxy, timeout=10) as sock:
        sock.sendall(data)
        return read_reply(sock)


# ------------------------------------------------------------------------------------------ HTTP denials
def test_policy_deny_body_id_finds_its_record(gateway):
    sbx = gateway.admit("gw-basic")
    with sbx.client() as c:
        r = c.post(sbx.url("api.test", "/v1/not-a-post-path"), content=b"x")
    assert r.status_code == 403
    rid = body_id(r.content, {k.lower(): v for k, v in r.headers.items()})
    rec = decision_of(gateway, rid, "http_request")
    assert rec["egressgate.decision"] == "deny" and rec["egressgate.reason"] == r.json()["reason"]
    assert rec["egressgate.sandbox.id"] == sbx.id
    # positive control: an allowed request's id (header) finds its decision and its outcome
    with sbx.client() as c:
        ok = c.get(sbx.url("api.test", "/echo"))
    assert ok.status_code == 200
    ok_id = ok.headers["x-egressgate-request-id"]
    assert decision_of(gateway, ok_id)["egressgate.decision"] == "allow"
    assert wait_for(lambda: any(r.get("egressgate.operation") == "outcome" for r in audit_find(gateway, ok_id)))


def test_connect_deny_body_id_finds_its_record(gateway):
    sbx = gateway.admit("gw-basic")
    sock, head = connect_tunnel(gateway, sbx, "other.test:1")  # no rule for port 1
    sock.close()
    assert head.startswith(b"HTTP/1.1 403")
    _, _, body = head.partition(b"\r\n\r\n")
    rec = decision_of(gateway, body_id(body), "connect")
    assert rec["egressgate.decision"] == "deny" and rec["server.address"] == "other.test"


def test_budget_429_body_id_finds_its_record(gateway):
    sbx = gateway.admit("gw-budget")  # outbound_bytes_max: 4000
    port = gateway.world.https_port
    sock, head = connect_tunnel(gateway, sbx, f"api.test:{port}")
    assert head.startswith(b"HTTP/1.1 200")
    with tls_wrap(sock, gateway, "api.test") as tls:
        head = f"POST /upload HTTP/1.1\r\nHost: api.test:{port}\r\nContent-Length: 5000\r\n\r\n"
        tls.sendall(head.encode() + b"b" * 5000)
        status, headers, body = read_reply(tls)
    assert status == 429
    rec = decision_of(gateway, body_id(body, headers), "http_request")
    assert rec["egressgate.reason"] == "budget_exceeded"


# ------------------------------------------------------------------------------------------ identity
@pytest.mark.parametrize("auth", [None, "wrong-token", "Bearer not-basic"])
def test_identity_unknown_connect_records_target_not_credentials(gateway, auth):
    port = gateway.world.https_port
    sbx = gateway.admit("gw-basic")
    header = ""
    if auth == "wrong-token":
        header = f"Proxy-Authorization: {basic(sbx.id, 'wrong-token-s3cr3t')}\r\n"
    elif auth is not None:
        header = f"Proxy-Authorization: {auth}\r\n"
    target = f"API.test:{port}"  # not canonical as sent: the record carries the canonical form too
    status, headers, body = raw_proxy_request(
        gateway, f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{header}\r\n".encode())
    assert status == 407 and json.loads(body)["reason"] == "identity_unknown"
    rec = decision_of(gateway, body_id(body, headers), "connect")
    assert rec["egressgate.reason"] == "identity_unknown"
    assert rec["egressgate.target.as_sent"] == target
    assert rec["server.address"] == "api.test" and int(rec["server.port"]) == port
    assert rec["egressgate.target.canonical"] == f"api.test:{port}"
    line = json.dumps(rec)
    assert "s3cr3t" not in line and sbx.token not in line and "not-basic" not in line
    assert not any("authorization" in k.lower() for k in rec)


def test_identity_unknown_plain_request_records_target(gateway):
    port = gateway.world.http_port
    status, headers, body = raw_proxy_request(
        gateway,
        f"GET http://api.test:{port}/v1/%7Eitems/./x?q=1 HTTP/1.1\r\nHost: api.test:{port}\r\n"
        f"Proxy-Authorization: {basic('nobody', 'tok-s3cr3t')}\r\n\r\n".encode(),
    )
    assert status == 407
    rec = decision_of(gateway, body_id(body, headers), "http_request")
    assert rec["egressgate.reason"] == "identity_unknown"
    assert rec["server.address"] == "api.test" and int(rec["server.port"]) == port
    assert rec["http.request.method"] == "GET"
    assert rec["egressgate.target.canonical"] == f"http://api.test:{port}/v1/~items/x"
    assert "s3cr3t" not in json.dumps(rec)


def test_identity_unknown_uncanonical_target_is_recorded_raw_only(gateway):
    """A target that does not canonicalize is kept as sent (egressgate.target.as_sent) and nothing is
    guessed: no host, no canonical target."""
    status, headers, body = raw_proxy_request(
        gateway, b"CONNECT 999.1.1.1:443 HTTP/1.1\r\nHost: 999.1.1.1:443\r\n\r\n")
    assert status == 407
    rec = decision_of(gateway, body_id(body, headers), "connect")
    assert rec["egressgate.target.as_sent"] == "999.1.1.1:443"  # mitmproxy accepts it; canon.py does not
    assert rec.get("server.address") is None and rec.get("egressgate.target.canonical") is None


def test_revoked_sandbox_connect_records_target(gateway):
    sbx = gateway.admit("gw-basic")
    assert gateway.revoke(sbx.id).status_code in (200, 204)
    sock, head = connect_tunnel(gateway, sbx, f"api.test:{gateway.world.https_port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 407")
    _, _, body = head.partition(b"\r\n\r\n")
    rec = decision_of(gateway, body_id(body), "connect")
    assert rec["egressgate.reason"] == "sandbox_revoked"
    assert rec["egressgate.target.canonical"] == f"api.test:{gateway.world.https_port}"
    assert sbx.token not in json.dumps(rec)


# ------------------------------------------------------------------------------------------ raw TCP
def test_raw_tcp_deny_body_id_finds_its_record(gateway):
    sbx = gateway.admit("gw-tcp")
    status, headers, body = raw_bytes_in_tunnel(gateway, sbx, f"api.test:{gateway.world.https_port}",
                                                b"\x00\x01 raw bytes, neither TLS nor HTTP\n")
    assert status == 403 and json.loads(body)["reason"] == "protocol_not_allowed"
    rec = decision_of(gateway, body_id(body, headers), "connect")
    assert rec["egressgate.reason"] == "protocol_not_allowed" and rec["url.scheme"] == "tcp"


def relay_once(gw, sbx, target: str) -> None:
    sock, head = connect_tunnel(gw, sbx, target)
    assert head.startswith(b"HTTP/1.1 200")
    sock.sendall(b"\x00ping")
    sock.settimeout(5)
    assert sock.recv(100) == b"echo:\x00ping"
    sock.close()


def tcp_outcome_and_decisions(gw, sandbox_id: str) -> tuple[dict, list[dict]]:
    def outcomes():
        return [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox_id
                and r.get("egressgate.operation") == "outcome" and r.get("url.scheme") == "tcp"]

    assert wait_for(lambda: outcomes(), timeout=5)
    out = outcomes()[0]
    found = audit_find(gw, out["egressgate.request.id"])
    return out, [r for r in found if r.get("egressgate.operation") != "outcome"]


def test_raw_tcp_outcome_shares_the_connect_decision_id(gateway):
    """tcp.test is allowed at the CONNECT by a tcp rule only: the relay's outcome is that decision's."""
    sbx = gateway.admit("gw-tcp")
    relay_once(gateway, sbx, f"tcp.test:{gateway.world.tcp_port}")
    out, decisions = tcp_outcome_and_decisions(gateway, sbx.id)
    assert int(out["egressgate.bytes.out"]) == 5
    assert len(decisions) == 1, decisions
    assert decisions[0]["egressgate.decision"] == "allow" and decisions[0]["egressgate.operation"] == "connect"
    assert decisions[0]["egressgate.rule"] == out["egressgate.rule"] == "tcp-echo"


@pytest.fixture(scope="module")
def gw_ids(gateway, tmp_path_factory):
    """A second gateway, started through the fault launcher (a planted bug for `fault=snapshot` sandboxes
    only), with one extra policy: tcp.test allowed by an https rule *and* a tcp rule, so raw TCP is decided
    inside the (intercepting) tunnel by layers/next_layer.py rather than at the CONNECT."""
    tmp = tmp_path_factory.mktemp("gw-ids")
    world = gateway.world
    (tmp / "policies").mkdir()
    (tmp / "policies" / "gw-mixed-tcp.yaml").write_text(yaml.safe_dump({
        "sandbox": {"name": "gw-mixed-tcp"},
        "network": {"allow_private": ["127.0.0.1/32"],
                    "https": {"allow": [{"id": "tcp-as-https", "host": "tcp.test", "ports": [world.tcp_port]}]},
                    "tcp": {"allow": [{"id": "tcp-raw", "host": "tcp.test", "ports": [world.tcp_port]}]}},
    }))
    gw = start_gateway(world, tmp, launcher=LAUNCHER)
    try:
        yield gw
    finally:
        stop_gateway(gw)


def test_raw_tcp_decided_in_tunnel_outcome_shares_its_decision_id(gw_ids):
    sbx = gw_ids.admit("gw-mixed-tcp")
    relay_once(gw_ids, sbx, f"tcp.test:{gw_ids.world.tcp_port}")
    out, decisions = tcp_outcome_and_decisions(gw_ids, sbx.id)
    assert len(decisions) == 1, decisions
    assert decisions[0]["url.scheme"] == "tcp"  # the in-tunnel raw-TCP decision
    assert decisions[0]["egressgate.rule"] == out["egressgate.rule"] == "tcp-raw"


# ------------------------------------------------------------------------------------------ internal_error
def test_internal_error_body_id_finds_its_record(gw_ids):
    world = gw_ids.world
    broken = gw_ids.admit("gw-basic", {"fault": "snapshot"})
    # CONNECT: the decision addon's state read raises; the refusal is answered on the CONNECT
    sock, head = connect_tunnel(gw_ids, broken, f"api.test:{world.https_port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 500"), head
    _, _, body = head.partition(b"\r\n\r\n")
    assert json.loads(body)["reason"] == "internal_error"
    rec = decision_of(gw_ids, body_id(body), "connect")
    assert rec["egressgate.decision"] == "deny" and rec["egressgate.reason"] == "internal_error"
    assert rec["server.address"] == "api.test" and rec["egressgate.sandbox.id"] == broken.id
    assert rec["egressgate.detail"].startswith("hook=http_connect")
    # a plain-proxy request: same, with the header naming the same id
    mark = world.hits.mark()
    with httpx.Client(proxy=broken.proxy_url, timeout=10, trust_env=False) as c:
        r = c.get(f"http://api.test:{world.http_port}/v1/x")
    assert r.status_code == 500 and r.json()["reason"] == "internal_error"
    rec = decision_of(gw_ids, body_id(r.content, {k.lower(): v for k, v in r.headers.items()}), "http_request")
    assert rec["egressgate.reason"] == "internal_error"
    assert rec["egressgate.target.canonical"] == f"http://api.test:{world.http_port}/v1/x"
    assert world.hits.since(mark) == []
    # positive control: the same gateway serves a sandbox without the planted fault
    ok = gw_ids.admit("gw-basic")
    with httpx.Client(proxy=ok.proxy_url, timeout=10, trust_env=False) as c:
        assert c.get(f"http://api.test:{world.http_port}/v1/x").status_code == 200
