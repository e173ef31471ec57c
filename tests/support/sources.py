"""Sandboxes told apart by their loopback source address, and requests sent from a chosen one: the
tests of tokens bound to their admitted addresses (tests/gateway and tests/state_redis)."""

from __future__ import annotations

import itertools
import socket

from tests.support.gwworld import Gateway, Sandbox, auth, dial, tls_wrap
from tests.support.http1 import read_reply

# unique within this test process: every xdist worker runs its own gateways, and an address is only
# registered in the gateway a test admits on; 127.83/16 is used by nothing else in the suite
_HOSTS = itertools.count(10)


def fresh_address() -> str:
    n = next(_HOSTS)
    return f"127.83.{n // 250}.{n % 250 + 2}"


def admit(gw: Gateway, addresses: list[str], policy: str = "gw-basic") -> Sandbox:
    data = gw.admit_sandbox({"policy": policy, "labels": {}, "addresses": addresses})
    assert data["addresses"] == addresses
    return Sandbox(id=data["id"], token=data["token"], proxy_url=data["proxy_url"], env=data["env"], gw=gw)


def connect_from(gw: Gateway, source: str, sbx: Sandbox, target: str) -> tuple[int, bytes, socket.socket]:
    sock = dial(gw, source)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth(sbx)}\r\n".encode())
    status, _headers, body = read_reply(sock)
    return status, body, sock


def plain_from(gw: Gateway, source: str, sbx: Sandbox, path: str) -> tuple[int, bytes]:
    port = gw.world.http_port
    with dial(gw, source) as sock:
        sock.sendall(f"GET http://api.test:{port}{path} HTTP/1.1\r\nHost: api.test:{port}\r\n{auth(sbx)}"
                     "Connection: close\r\n\r\n".encode())
        status, _headers, body = read_reply(sock)
    return status, body


def https_get(gw: Gateway, sock: socket.socket, path: str) -> int:
    tls = tls_wrap(sock, gw, "api.test")
    try:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: api.test:{gw.world.https_port}\r\nConnection: close\r\n\r\n"
                    .encode())
        return read_reply(tls)[0]
    finally:
        tls.close()


def mismatch_records(gw: Gateway, sandbox_id: str) -> list[dict]:
    return [r for r in gw.audit_records() if r.get("egressgate.reason") == "identity_address_mismatch"
            and r.get("egressgate.sandbox.id") == sandbox_id]
