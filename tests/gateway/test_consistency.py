"""CONNECT target, SNI, Host / :authority and absolute-form URI must all agree (domain fronting)."""

from __future__ import annotations

import json
import socket

import pytest

from tests.support.gwworld import connect_tunnel, tls_wrap
from tests.support.http1 import read_reply


def tunnel_request(gateway, sbx, connect: str, sni: str | None, request: bytes) -> tuple[int, dict, bytes]:
    sock, head = connect_tunnel(gateway, sbx, connect)
    assert head.startswith(b"HTTP/1.1 200"), head
    tls = tls_wrap(sock, gateway, sni)
    try:
        tls.sendall(request)
        return read_reply(tls)
    finally:
        tls.close()


def test_host_header_must_name_connect_target(gateway):
    sbx = gateway.admit("gw-basic")
    port = gateway.world.https_port
    mark = gateway.world.hits.mark()
    # other.test is itself allowed: the point is that the tunnel was opened to api.test
    status, headers, body = tunnel_request(
        gateway, sbx, f"api.test:{port}", "api.test",
        f"GET /echo HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n".encode())
    assert status == 421 and headers["x-egressgate-decision"] == "deny"
    assert json.loads(body)["reason"] == "host_mismatch"
    assert gateway.world.hits.since(mark) == []
    # positive control: same tunnel shape, matching Host, reaches the upstream
    status, _, _ = tunnel_request(gateway, sbx, f"api.test:{port}", "api.test",
                                  f"GET /echo HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n".encode())
    assert status == 200
    assert [h["host"] for h in gateway.world.hits.since(mark)] == [f"api.test:{port}"]


@pytest.mark.parametrize("host", ["API.TEST", "api.test.", "api.test:{port}", "api.test"])
def test_host_spellings_of_the_same_target_accepted(gateway, host):
    sbx = gateway.admit("gw-basic")
    port = gateway.world.https_port
    status, _, _ = tunnel_request(gateway, sbx, f"api.test:{port}", "api.test",
                                  f"GET /echo HTTP/1.1\r\nHost: {host.format(port=port)}\r\n\r\n".encode())
    assert status == 200


@pytest.mark.parametrize("host", ["api.test:1", "user@api.test", "api.test@other.test", "127.0.0.1",
                                  "api.test.other.test", "api%2etest"])
def test_host_variants_naming_something_else_refused(gateway, host):
    sbx = gateway.admit("gw-basic")
    port = gateway.world.https_port
    mark = gateway.world.hits.mark()
    status, _, body = tunnel_request(gateway, sbx, f"api.test:{port}", "api.test",
                                     f"GET /echo HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    assert status in (400, 403, 421), body
    assert gateway.world.hits.since(mark) == []


def test_duplicate_and_missing_host_refused(gateway):
    sbx = gateway.admit("gw-basic")
    port = gateway.world.https_port
    mark = gateway.world.hits.mark()
    status, _, _ = tunnel_request(
        gateway, sbx, f"api.test:{port}", "api.test",
        f"GET /echo HTTP/1.1\r\nHost: api.test:{port}\r\nHost: other.test:{port}\r\n\r\n".encode())
    assert status in (400, 403)
    status, _, _ = tunnel_request(gateway, sbx, f"api.test:{port}", "api.test", b"GET /echo HTTP/1.0\r\n\r\n")
    assert status in (400, 403)
    assert gateway.world.hits.since(mark) == []


def test_sni_must_name_connect_target(gateway):
    """Domain fronting: CONNECT to an allowed name, another (also allowed) name in the SNI."""
    sbx = gateway.admit("gw-basic")
    port = gateway.world.https_port
    mark, sni_mark = gateway.world.hits.mark(), len(gateway.world.snis)
    status, _, body = tunnel_request(gateway, sbx, f"api.test:{port}", "other.test",
                                     f"GET /echo HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n".encode())
    assert status == 421 and json.loads(body)["reason"] == "host_mismatch"
    status, _, _ = tunnel_request(gateway, sbx, f"api.test:{port}", "other.test",
                                  f"GET /echo HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n".encode())
    assert status == 421
    assert gateway.world.hits.since(mark) == []
    assert "other.test" not in gateway.world.snis[sni_mark:]  # no upstream TLS was opened for the front
    # positive control: SNI naming the target works
    status, _, _ = tunnel_request(gateway, sbx, f"other.test:{port}", "other.test",
                                  f"GET /echo HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n".encode())
    assert status == 200


def test_missing_sni_gets_connect_name_upstream(gateway):
    sbx = gateway.admit("gw-basic")
    port = gateway.world.https_port
    sni_mark = len(gateway.world.snis)
    status, _, _ = tunnel_request(gateway, sbx, f"other.test:{port}", None,
                                  f"GET /echo HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n".encode())
    assert status == 200
    assert gateway.world.snis[sni_mark:] == ["other.test"]


def test_absolute_form_inside_tunnel_must_match(gateway):
    sbx = gateway.admit("gw-basic")
    port = gateway.world.https_port
    mark = gateway.world.hits.mark()
    status, _, _ = tunnel_request(
        gateway, sbx, f"api.test:{port}", "api.test",
        f"GET https://other.test:{port}/echo HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n".encode())
    assert status in (400, 421)
    assert gateway.world.hits.since(mark) == []


def plain(gateway, sbx, request: bytes) -> tuple[int, dict, bytes]:
    import base64

    auth = base64.b64encode(f"{sbx.id}:{sbx.token}".encode()).decode()
    head, _, rest = request.partition(b"\r\n")
    data = head + b"\r\nProxy-Authorization: Basic " + auth.encode() + b"\r\n" + rest
    with socket.create_connection(gateway.proxy, timeout=10) as s:
        s.sendall(data)
        return read_reply(s)


def test_absolute_form_and_host_must_agree(gateway):
    sbx = gateway.admit("gw-basic")
    port = gateway.world.http_port
    mark = gateway.world.hits.mark()
    status, _, body = plain(gateway, sbx,
                            f"GET http://api.test:{port}/echo HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n".encode())
    assert status == 421 and json.loads(body)["reason"] == "host_mismatch"
    status, _, _ = plain(gateway, sbx,
                         f"GET http://user:pw@api.test:{port}/echo HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n".encode())
    assert status in (400, 403)
    assert gateway.world.hits.since(mark) == []
    status, _, _ = plain(gateway, sbx,
                         f"GET http://api.test:{port}/echo HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n".encode())
    assert status == 200


def test_connect_userinfo_refused(gateway):
    sbx = gateway.admit("gw-basic")
    sock, head = connect_tunnel(gateway, sbx, f"user@api.test:{gateway.world.https_port}")
    sock.close()
    assert head.split(b" ")[1] in (b"400", b"403")


@pytest.mark.parametrize("smuggle", ["clte", "tecl", "te-obfuscated"])
def test_request_smuggling_refused(gateway, smuggle):
    sbx = gateway.admit("gw-basic")
    port = gateway.world.http_port
    mark = gateway.world.hits.mark()
    hidden = f"GET /smuggled HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n"
    if smuggle == "clte":
        req = (f"POST http://api.test:{port}/echo HTTP/1.1\r\nHost: api.test:{port}\r\nContent-Length: "
               f"{5 + len(hidden)}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{hidden}")
    elif smuggle == "tecl":
        chunk = hidden
        req = (f"POST http://api.test:{port}/echo HTTP/1.1\r\nHost: api.test:{port}\r\nContent-Length: 4\r\n"
               f"Transfer-Encoding: chunked\r\n\r\n{len(chunk):x}\r\n{chunk}\r\n0\r\n\r\n")
    else:
        req = (f"POST http://api.test:{port}/echo HTTP/1.1\r\nHost: api.test:{port}\r\nContent-Length: "
               f"{len(hidden)}\r\nTransfer-Encoding : chunked\r\n\r\n{hidden}")
    status, _, _ = plain(gateway, sbx, req.encode())
    assert status == 400
    assert [h for h in gateway.world.hits.since(mark) if "smuggled" in h["path"]] == []
