"""A plain-proxy keep-alive connection keeps its identity only for the exact Proxy-Authorization that
bound it: identity.py re-reads the sandbox record per request (revocation) but skips re-hashing a token it
already verified on this connection. Another token, a missing header or another sandbox on the same
connection must still be refused, and nothing of a refused request may reach the upstream."""

from __future__ import annotations

import base64
import socket

from tests.support.http1 import read_reply


def _auth(sandbox_id: str, token: str) -> str:
    return "Proxy-Authorization: Basic " + base64.b64encode(f"{sandbox_id}:{token}".encode()).decode() + "\r\n"


def _get(sock: socket.socket, port: int, path: str, auth: str) -> tuple[int, bytes]:
    sock.sendall(f"GET http://api.test:{port}{path} HTTP/1.1\r\nHost: api.test:{port}\r\n{auth}\r\n".encode())
    status, _headers, body = read_reply(sock)
    return status, body


def test_the_binding_header_is_reused_another_is_checked_again(gateway) -> None:
    sbx, other = gateway.admit("gw-basic"), gateway.admit("gw-basic")
    port = gateway.world.http_port
    good = _auth(sbx.id, sbx.token)
    forged = _auth(sbx.id, sbx.token[:-2] + ("AA" if not sbx.token.endswith("AA") else "BB"))
    mark = gateway.world.hits.mark()
    with socket.create_connection(gateway.proxy, timeout=10) as sock:
        assert _get(sock, port, "/echo/1", good)[0] == 200  # positive control: bound and forwarded
        assert _get(sock, port, "/echo/2", good)[0] == 200  # the same header: reused
        status, body = _get(sock, port, "/echo/forged", forged)
        assert status == 407 and b"identity_unknown" in body
    with socket.create_connection(gateway.proxy, timeout=10) as sock:
        assert _get(sock, port, "/echo/3", good)[0] == 200
        status, body = _get(sock, port, "/echo/other", _auth(other.id, other.token))
        assert status == 403 and b"invalid_request" in body  # one connection, one sandbox
    with socket.create_connection(gateway.proxy, timeout=10) as sock:
        assert _get(sock, port, "/echo/4", good)[0] == 200
        status, body = _get(sock, port, "/echo/none", "")
        assert status == 407 and b"identity_unknown" in body
    assert sorted(h["path"] for h in gateway.world.hits.since(mark)) == ["/echo/1", "/echo/2", "/echo/3", "/echo/4"]
