"""Tunnels that are not HTTP, revocation of live connections, the admin API, the CLI, audit records,
policy reload (file watch and SIGHUP) and clean shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import time

import httpx
import pytest
import yaml

from tests.support import cli
from tests.support.gwworld import connect_tunnel, raw_bytes_in_tunnel, start_gateway
from tests.support.http1 import read_reply
from tests.support.launcher import EGRESSGATE, stop_gateway
from tests.support.replicas import hold_sse
from tests.support.waiting import wait_for


def test_non_http_bytes_in_tunnel_refused_with_control(gateway):
    """open.test:tcp_port is allowed by an https rule only: the tunnel opens, raw bytes never reach the
    echo server (the canary here); tcp.test:tcp_port (a tcp rule) relays the same bytes."""
    world = gateway.world
    port = world.tcp_port
    sbx = gateway.admit("gw-tcp")
    before = len(world.hits.tcp)
    raw = b"\x00\x01\x02 raw bytes that are not http\n"
    status, _, body = raw_bytes_in_tunnel(gateway, sbx, f"open.test:{port}", raw)
    assert status == 403 and json.loads(body)["reason"] == "protocol_not_allowed"
    time.sleep(0.3)
    assert all(d == b"" for d in world.hits.tcp[before:])
    sock, head = connect_tunnel(gateway, sbx, f"tcp.test:{port}")
    assert head.startswith(b"HTTP/1.1 200")
    sock.sendall(raw)
    sock.settimeout(5)
    assert sock.recv(100).startswith(b"echo:\x00\x01\x02")
    sock.close()


def test_raw_tcp_refused_unless_tcp_rule(gateway):
    world = gateway.world
    port = world.tcp_port
    before = len(world.hits.tcp)
    sbx = gateway.admit("gw-tcp")
    sock, head = connect_tunnel(gateway, sbx, f"other.test:{port}")  # no rule at all
    assert head.startswith(b"HTTP/1.1 403")
    sock.close()
    # tunnel to an https-only destination carrying non-HTTP bytes
    sock, head = connect_tunnel(gateway, sbx, f"api.test:{world.https_port}")
    assert head.startswith(b"HTTP/1.1 200")
    sock.sendall(b"\x16 not-tls-not-http \x00\x00\n")
    status, _headers, body = read_reply(sock, timeout=5)
    sock.close()
    assert status == 403 and json.loads(body)["reason"] == "protocol_not_allowed"
    # positive control: the tcp rule relays the same bytes to the echo server
    sock, head = connect_tunnel(gateway, sbx, f"tcp.test:{port}")
    assert head.startswith(b"HTTP/1.1 200")
    sock.sendall(b"\x00hello")
    sock.settimeout(5)
    assert sock.recv(100) == b"echo:\x00hello"
    sock.close()
    assert wait_for(lambda: b"\x00hello" in world.hits.tcp[before:])


def test_raw_tcp_counts_against_budget_and_is_cut(gateway):
    world = gateway.world
    sbx = gateway.admit("gw-tcp-budget")  # outbound_bytes_max: 1000
    before = len(world.hits.tcp)
    sock, head = connect_tunnel(gateway, sbx, f"tcp.test:{world.tcp_port}")
    assert head.startswith(b"HTTP/1.1 200")
    sock.settimeout(5)
    sock.sendall(b"a" * 600)
    got = b""
    while len(got) < 605:
        got += sock.recv(4096)
    assert got == b"echo:" + b"a" * 600
    sock.sendall(b"b" * 600)  # crosses 1000: dropped, connection aborted
    rest = b""
    try:
        while chunk := sock.recv(4096):
            rest += chunk
    except OSError:
        pass
    sock.close()
    assert b"b" not in rest
    assert wait_for(lambda: len(world.hits.tcp) > before)
    assert all(b"b" not in d for d in world.hits.tcp[before:])
    assert any(d == b"a" * 600 for d in world.hits.tcp[before:])
    sock, head = connect_tunnel(gateway, sbx, f"tcp.test:{world.tcp_port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 200")  # 400 bytes left: a new tunnel may still open


def test_upstream_101_to_raw_protocol_never_relays(gateway):
    """A hostile upstream switching to a non-websocket protocol would turn the connection into a raw
    relay; the gateway kills it before a byte of the client's follow-up reaches the upstream."""
    import base64

    world = gateway.world
    sbx = gateway.admit("gw-basic")
    before = len(world.hits.tcp)
    auth = base64.b64encode(f"{sbx.id}:{sbx.token}".encode()).decode()
    with socket.create_connection(gateway.proxy, timeout=5) as s:
        s.sendall(f"GET http://other.test:{world.evil_port}/ HTTP/1.1\r\nHost: other.test:{world.evil_port}\r\n"
                  f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
        s.settimeout(5)
        with contextlib.suppress(OSError):
            s.recv(65536)
            s.sendall(b"SMUGGLED-RAW-BYTES")
            time.sleep(0.3)
            s.sendall(b"SMUGGLED-RAW-BYTES")
    time.sleep(0.3)
    assert not any(b"SMUGGLED" in d for d in world.hits.tcp[before:]), world.hits.tcp[before:]


def test_revocation_closes_live_connection(gateway):
    sbx = gateway.admit("gw-basic")
    key = f"rev{time.monotonic_ns()}"
    held = hold_sse(sbx, key, hold=180)  # the upstream holds 180 s; the client never times out
    assert held.wait_first()
    r = gateway.revoke(sbx.id)
    assert r.status_code == 200 and r.json()["revoked"] is True
    assert held.join(60), "the stream outlived the revocation"
    assert "data: last" not in held.outcome.get("lines", []), held.outcome  # cut, not the hold's end
    gateway.world.release_sse(key)
    # and the identity is refused from now on
    sock, head = connect_tunnel(gateway, sbx, f"api.test:{gateway.world.https_port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 407") and b"sandbox_revoked" in head
    assert gateway.revoke(sbx.id).status_code == 200  # idempotent on a known id
    assert gateway.revoke("sbx-nope").status_code == 404


def test_admin_api_requires_token_and_token_file_is_private(gateway):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {gateway.token}"}):
        r = httpx.post(f"http://{gateway.admin}/v1/sandboxes", json={"policy": "gw-basic"}, headers=headers,
                       trust_env=False)
        assert r.status_code == 401
    assert stat.S_IMODE(os.stat(gateway.var / "admin.token").st_mode) == 0o600
    r = httpx.post(f"http://{gateway.admin}/v1/sandboxes", json={"policy": "nope"},
                   headers={"Authorization": f"Bearer {gateway.token}"}, trust_env=False)
    assert r.status_code == 404
    assert httpx.get(f"http://{gateway.admin}/healthz", trust_env=False).json()["status"] == "ok"
    ca_dir = gateway.var / "ca"
    assert stat.S_IMODE(os.stat(ca_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ca_dir / "mitmproxy-ca.pem").st_mode) == 0o600


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return cli.run([EGRESSGATE, *args], timeout=60,
                   env={**os.environ, "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"})


def test_cli_admit_revoke_and_ca(gateway):
    res = run_cli("sandbox", "admit", "--config", str(gateway.config), "--policy", "gw-basic", "--label", "team=x")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["id"].startswith("sbx-") and data["token"]
    assert data["env"]["HTTPS_PROXY"] == data["proxy_url"]
    assert data["env"]["NO_PROXY"] == "" and "NO_PROXY" in data["notes"]
    # stderr says what a sandbox admitted by hand does not get (docs/policy.md, "Who enforces each key")
    assert "sets keys only `sandbox run` enforces (sandbox.root_fs, sandbox.tmp.max_bytes" in res.stderr
    assert "a sandbox admitted by hand and routed through the gateway does not get them" in res.stderr
    with httpx.Client(proxy=data["proxy_url"], verify=False, trust_env=False) as c:  # noqa: S501 - checking auth only
        r = c.get(f"https://api.test:{gateway.world.https_port}/echo")
    assert r.status_code == 200
    res = run_cli("sandbox", "revoke", "--config", str(gateway.config), data["id"])
    assert res.returncode == 0 and json.loads(res.stdout)["revoked"] is True
    res = run_cli("sandbox", "admit", "--config", str(gateway.config), "--policy", "nope")
    assert res.returncode != 0 and "unknown_policy" in res.stderr
    res = run_cli("ca", "path", "--config", str(gateway.config))
    assert res.returncode == 0 and res.stdout.strip().endswith("mitmproxy-ca-cert.pem")
    res = run_cli("ca", "export", "--config", str(gateway.config))
    assert res.stdout.count("BEGIN CERTIFICATE") == 1 and "PRIVATE" not in res.stdout


def test_audit_records_allow_and_deny(gateway):
    sbx = gateway.admit("gw-basic")
    with sbx.client() as c:
        ok = c.get(sbx.url("api.test", "/echo"))
        denied = c.get(sbx.url("api.test", "/nope"))
    rid_ok, rid_deny = ok.headers["x-egressgate-request-id"], denied.json()["request_id"]

    def find():
        recs = gateway.audit_records()
        by = {}
        for r in recs:
            if r.get("egressgate.sandbox.id") == sbx.id:
                by.setdefault(r.get("egressgate.request.id"), []).append(r)
        return by

    assert wait_for(lambda: rid_ok in find() and rid_deny in find())
    by = find()
    text = json.dumps(by)
    assert sbx.token not in text
    decisions = [r for recs in by.values() for r in recs if r.get("egressgate.decision") in ("allow", "deny")]
    assert any(r.get("egressgate.reason") == "path_not_allowed" for r in decisions)
    assert any(r.get("egressgate.reason") == "rule_matched" for r in decisions)


@pytest.fixture
def gateway2(gateway, tmp_path):
    """A second gateway (own process) for reload and shutdown tests."""
    gw = start_gateway(gateway.world, tmp_path)
    yield gw
    stop_gateway(gw)


def test_reload_invalid_keeps_old_then_valid_applies(gateway2):
    gw = gateway2
    sbx = gw.admit("gw-basic")
    path = gw.policy_dir / "gw-basic.yaml"
    good = yaml.safe_load(path.read_text())
    with sbx.client() as c:
        assert c.get(sbx.url("api.test", "/echo")).status_code == 200
    bad = json.loads(json.dumps(good))
    bad["network"]["https"]["allow"][0]["methodz"] = ["GET"]
    path.write_text(yaml.safe_dump(bad))
    stderr = gw.var.parent / "gateway.stderr"
    assert wait_for(lambda: "methodz" in stderr.read_text(), timeout=10)
    assert "network.https.allow[0].methodz" in stderr.read_text()
    with sbx.client() as c:
        assert c.get(sbx.url("api.test", "/echo")).status_code == 200  # old policy still in force
    # valid change: /echo no longer allowed; applied via SIGHUP (and the watch)
    changed = json.loads(json.dumps(good))
    changed["network"]["https"]["allow"][0]["paths"] = ["/v1/**"]
    path.write_text(yaml.safe_dump(changed))
    gw.proc.send_signal(signal.SIGHUP)

    def denied_now():
        with sbx.client() as c:
            return c.get(sbx.url("api.test", "/echo")).status_code == 403
    assert wait_for(denied_now, timeout=10)


def test_connect_timeout(gateway, tmp_path):
    """mitmproxy has no connect timeout; ours cancels an unanswered connect after upstream.connect_timeout."""
    world = gateway.world
    target = f"hang.test:{world.blackhole_port}"
    # control: with the session gateway's 10 s timeout the CONNECT is still pending after 2 s
    sbx = gateway.admit("gw-basic")
    sock = socket.create_connection(gateway.proxy, timeout=10)
    auth = __import__("base64").b64encode(f"{sbx.id}:{sbx.token}".encode()).decode()
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
    sock.settimeout(2)
    with pytest.raises(TimeoutError):
        sock.recv(100)
    sock.close()
    gw = start_gateway(world, tmp_path / "gw", {"upstream": {
        "resolver": f"127.0.0.1:{world.dns_port}", "ca_bundle": str(gateway.var.parent / "upstream-ca.pem"),
        "connect_timeout": 1}})
    try:
        sbx = gw.admit("gw-basic")
        start = time.monotonic()
        sock, head = connect_tunnel(gw, sbx, target)
        sock.close()
        elapsed = time.monotonic() - start
        assert head.startswith(b"HTTP/1.1 502"), head
        assert 0.8 < elapsed < 4, elapsed
    finally:
        stop_gateway(gw)


def test_sigterm_stops_cleanly(gateway2):
    gw = gateway2
    assert stop_gateway(gw) == 0
    assert not (gw.var / "gateway.json").exists()
