"""From inside `egressgate sandbox run --runtime netns`, hostile code that ignores the proxy (HTTP_PROXY
unset, NO_PROXY=*) tries every other way out. None reaches its canary; the same attempts from the world's
`open` namespace (same position off gw, no egressgate rules) DO reach them: the positive control that a
direct route exists and only the runtime's plumbing stands in the way.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import networld as nw
import pytest

from runtimes.conftest import DENIED_FILE_NAME
from runtimes.harness import CALLER_SECRET, Gateway, sandbox_id

pytestmark = pytest.mark.netns

PROBE = (Path(__file__).with_name("probe.py")).read_text()
PY = "/usr/bin/python3"


def leak_name() -> str:
    return f"leak-{secrets.token_hex(4)}.evil.test"


def network_checks(leak: str, leak_tcp: str) -> list[list]:
    return [
        ["tcp", "169.254.169.254", 80, "GET / HTTP/1.0\r\nHost: 169.254.169.254\r\n\r\n"],  # 0 metadata
        ["tcp", "10.0.0.5", 80, "GET / HTTP/1.0\r\nHost: 10.0.0.5\r\n\r\n"],  # 1 private IP
        ["tcp", "fd00:ec2::254", 80, "GET / HTTP/1.0\r\n\r\n"],  # 2 IPv6 literal
        ["dns", nw.DNS_ADDR, leak, "udp"],  # 3 "public" resolver, UDP 53
        ["tcp", nw.DNS_ADDR, 853, ""],  # 4 DNS over TLS
        ["udp", nw.UPSTREAM, 443],  # 5 QUIC
        ["icmp", nw.UPSTREAM],  # 6 ICMP echo (unprivileged ICMP socket)
        ["raw", 1],  # 7 raw ICMP socket
        ["raw", 6],  # 8 raw TCP socket
        ["tls", "10.0.0.5", 443, "api.allowed.test"],  # 9 an allowed name "pinned" to a private IP (edited hosts)
        ["dns", nw.DNS_ADDR, leak_tcp, "tcp"],  # 10 "public" resolver, TCP 53
    ]


def probe_argv(checks: list[list]) -> list[str]:
    return [PY, "-c", PROBE, json.dumps(checks)]


def parse(stdout: str) -> list[dict]:
    return json.loads(stdout.strip().splitlines()[-1])


def test_admission_checks_inside(gateway: Gateway, host_files: Path) -> None:
    """The seed's admission checks: no docker.sock, no caller secret, /etc/shadow and a denied host file
    unreadable, no capabilities, /etc/hosts and /etc/resolv.conf not editable."""
    denied = str(host_files / DENIED_FILE_NAME)
    checks = [["env"], ["exists", "/var/run/docker.sock"], ["exists", "/run/docker.sock"],
              ["open", "/etc/shadow", "r"], ["open", denied, "r"], ["uid"],
              ["open", "/etc/hosts", "a"], ["open", "/etc/resolv.conf", "a"]]
    res = gateway.run(*probe_argv(checks), policy="rt-allow")
    assert res.returncode == 0, res.stderr
    env, sock1, sock2, shadow, masked, ident, hosts, resolv = parse(res.stdout)
    assert "AWS_SECRET_ACCESS_KEY" not in env["env"] and CALLER_SECRET not in json.dumps(env["env"])
    assert "NO_PROXY" not in env["env"] and "no_proxy" not in env["env"]
    assert env["env"]["EGRESSGATE_SANDBOX_ID"] == sandbox_id(res.stderr)
    assert "198.18.0.2:1" not in env["env"]["HTTP_PROXY"]  # the caller's proxy setting did not leak in
    assert env["env"]["SSL_CERT_FILE"] == "/etc/egressgate/ca.pem"
    assert not sock1["ok"] and not sock2["ok"]
    assert shadow == {"ok": False, "error": "EACCES"}
    assert masked == {"ok": False, "error": "EACCES"}
    assert ident["uid"] == 65534 and int(ident["caps"], 16) == 0
    assert hosts["error"] in ("EROFS", "EACCES") and resolv["error"] in ("EROFS", "EACCES")
    # positive control for the mask: the same file IS readable under a policy that does not deny it
    control = gateway.run(*probe_argv([["open", denied, "r"]]), policy="rt-nomask")
    assert parse(control.stdout) == [{"ok": True}], control.stderr


def test_no_direct_path_reaches_a_canary(gateway: Gateway, canaries: dict) -> None:
    world = gateway.world
    leak, leak_tcp = leak_name(), leak_name()
    mark = world.mark()
    res = gateway.run(*probe_argv(network_checks(leak, leak_tcp)), policy="rt-allow")
    assert res.returncode == 0, res.stderr
    out = parse(res.stdout)
    sid = sandbox_id(res.stderr)
    assert world.canary_hits(mark) == [], world.canary_hits(mark)
    assert canaries["dot"].hits == [] and canaries["quic"].hits == []
    assert not out[2]["ok"] and out[2]["error"] in ("ENETUNREACH", "EADDRNOTAVAIL", "EAFNOSUPPORT")
    # the "public" resolver's answer came from OUR resolver (it refuses the name); the world's never saw it
    assert out[3]["ok"] and out[3]["rcode"] in (3, 5), out[3]  # NXDOMAIN/REFUSED by the policy
    assert out[10]["ok"] and out[10]["rcode"] in (3, 5), out[10]
    queried = {q["qname"] for q in world.dns_queries(mark)}
    assert leak not in queried and leak_tcp not in queried
    assert not out[5]["ok"] or out[5]["reply_from"] is None  # QUIC: nothing answers, nothing arrived
    assert not out[6]["ok"] and not out[7]["ok"] and not out[8]["ok"]  # ICMP and raw sockets refused
    assert out[7]["error"] == "EPERM" and out[8]["error"] == "EPERM"
    # each DNS denial is audited with the sandbox id (identity = the sandbox's registered source address)
    records = gateway.records(predicate=lambda r: r.get("dns.question.name") == leak_tcp)
    names = {r.get("dns.question.name") for r in records
             if r.get("egressgate.sandbox.id") == sid and r.get("egressgate.decision") == "deny"}
    assert {leak, leak_tcp} <= names

    # positive control: the same attempts from `open` (no egressgate rules) reach every canary
    control_leak = leak_name()
    mark = world.mark()
    ctl = world.exec(world.open, *probe_argv(network_checks(control_leak, leak_name())), timeout=60)
    assert ctl.returncode == 0, ctl.stderr
    hit = {h["listener"] for h in world.canary_hits(mark)}
    assert {"metadata", "private", "metadata-v6", "private-tls"} <= hit, hit
    assert control_leak in {q["qname"] for q in world.dns_queries(mark)}
    assert canaries["dot"].hits and canaries["quic"].hits


def test_allowed_https_via_explicit_proxy(gateway: Gateway) -> None:
    """Positive control: the one way out works (curl uses the proxy and CA that admission handed out)."""
    world = gateway.world
    mark = world.mark()
    res = gateway.run("curl", "-sS", "--max-time", "10", "https://api.allowed.test/", policy="rt-allow")
    assert res.returncode == 0, res.stderr
    assert "upstream-tls" in {h.get("listener") for h in world.hits(mark)}
