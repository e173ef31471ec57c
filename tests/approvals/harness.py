"""The approval tests' gateway: the loopback world of tests/gateway (tests/support/gwworld.py) plus two
policies that differ only in `execution.require_approval_for`, and the admin API calls an operator makes."""

from __future__ import annotations

import json
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.gwworld import Gateway, Sandbox, World, auth, policies
from tests.support.http1 import read_reply
from tests.support.launcher import launch_loopback, write_policies


def approval_policies(w: World, kinds: list[str], name: str, resources: dict | None = None) -> dict[str, Any]:
    """api.test (GET /v1/**; POST /keyed with a credential) is allowed; everything else is outside the
    allowlist. other.test/admin/** is denied by rule, http://other.test/locked/** for a sandbox labelled
    tier=locked only; loopback 127.0.0.1 is allowed_private, the canary's
    127.0.0.2 is not."""
    return {"sandbox": {"name": name, "resources": resources or {}},
            "execution": {"require_approval_for": kinds}, "network": {
        "allow_private": ["127.0.0.1/32"],
        "https": {"allow": [{"id": "api", "host": "api.test", "ports": [w.https_port], "methods": ["GET"],
                             "paths": ["/v1/**"]},
                            {"id": "keyed", "host": "api.test", "ports": [w.https_port], "methods": ["POST"],
                             "paths": ["/keyed"], "credential": "billing"}],
                  "deny": [{"id": "no-admin", "host": "other.test", "paths": ["/admin/**"]}]},
        "http": {"deny": [{"id": "no-admin-http", "host": "other.test", "paths": ["/admin/**"]},
                          # only a sandbox admitted with tier=locked: the labels decide (and no approval lifts it)
                          {"id": "locked-tier", "host": "other.test", "paths": ["/locked/**"],
                           "when": {"labels": {"tier": ["locked"]}}}]}},
        "credentials": {"capabilities": {"billing": {"type": "jwt", "ttl_seconds": 120}}}}


def start(w: World, tmp: Path, extra_config: dict | None = None) -> Gateway:
    docs = {**policies(w), "ap-gated": approval_policies(w, ["network_expansion", "publish"], "ap-gated"),
            "ap-plain": approval_policies(w, ["publish", "persistent_write"], "ap-plain"),
            "ap-budget": approval_policies(w, ["network_expansion"], "ap-budget", {"outbound_bytes_max": 3000})}
    policy_dir = write_policies(tmp / "policies", docs)
    ca_bundle = tmp / "upstream-ca.pem"
    ca_bundle.write_bytes(w.ca.cert_pem.bytes())
    config = {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
        "policy": str(policy_dir), "var_dir": str(tmp / "var"),
        "broker": {"local_key_dir": str(tmp / "var" / "keys")},
        "upstream": {"resolver": f"127.0.0.1:{w.dns_port}", "ca_bundle": str(ca_bundle)},
        **(extra_config or {}),
    }
    return Gateway(**launch_loopback(tmp, config), policy_dir=policy_dir, world=w)


@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def http_get(gw: Gateway, sbx: Sandbox, host: str, path: str = "/", method: str = "GET") -> Reply:
    """An absolute-form plain-HTTP proxy request (the deny body is readable, unlike a refused CONNECT's)."""
    target = f"http://{host}:{gw.world.http_port}{path}"
    with socket.create_connection(gw.proxy, timeout=10) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: {host}:{gw.world.http_port}\r\n{auth(sbx)}"
                     "Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
        status, headers, body = read_reply(sock)
    return Reply(status, {k.lower(): v for k, v in headers.items()}, body)


def connect(gw: Gateway, sbx: Sandbox, host: str, port: int) -> Reply:
    """A CONNECT; a refusal answered inside the accepted tunnel (gateway/pipeline/refused_tunnel.py: a 200 carrying
    `X-Egressgate-Decision: deny`) is read as a client reads it, one request inside, and returned."""
    with socket.create_connection(gw.proxy, timeout=10) as sock:
        sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth(sbx)}\r\n".encode())
        status, headers, body = read_reply(sock)
        if status == 200 and {k.lower(): v for k, v in headers.items()}.get("x-egressgate-decision") == "deny":
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            status, headers, body = read_reply(sock)
    return Reply(status, {k.lower(): v for k, v in headers.items()}, body)


# the admin API is plain HTTP, yet every httpx call builds a TLS context and loads certifi's bundle into it
# (~16 ms of CPU each, tests/control_api/harness.py): one unused context for every call instead
_UNUSED_TLS = ssl.create_default_context()


def admin(gw: Gateway, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, f"http://{gw.admin}{path}", json=body, timeout=10, trust_env=False,
                         verify=_UNUSED_TLS, headers={"Authorization": f"Bearer {gw.token}"})


def approve(gw: Gateway, approval_id: str, **body: Any) -> httpx.Response:
    return admin(gw, "POST", f"/v1/approvals/{approval_id}/approve", body)


def records(gw: Gateway, **match: Any) -> list[dict]:
    return [r for r in gw.audit_records() if all(r.get(k) == v for k, v in match.items())]
