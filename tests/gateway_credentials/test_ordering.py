"""A credential is placed only after identity, the decision, Host/SNI consistency and address pinning
passed — each check is tried here on a credentialed route, with a positive control showing the
credential would have arrived had the check let it through. Also HTTP/2 clients and websockets."""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import time

import aiohttp
import httpx

from tests.support.bao import KV_SECRET
from tests.support.credworld import Gateway, last


def _tunnel(gw: Gateway, sbx: dict | None, authority: str, sni: str) -> tuple[ssl.SSLSocket | None, bytes]:
    sock = socket.create_connection(gw.proxy, timeout=10)
    auth = ""
    if sbx is not None:
        cred = base64.b64encode(f"{sbx['id']}:{sbx['token']}".encode()).decode()
        auth = f"Proxy-Authorization: Basic {cred}\r\n"
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{auth}\r\n".encode())
    head = sock.recv(4096)
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        try:
            while chunk := sock.recv(4096):  # the deny closes the connection after its body
                head += chunk
        except OSError:
            pass
        sock.close()
        return None, head
    ctx = ssl.create_default_context(cafile=gw.bundle)
    return ctx.wrap_socket(sock, server_hostname=sni), head


def _get(tls: ssl.SSLSocket, host_header: str, path: str = "/echo") -> bytes:
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n".encode())
    data = b""
    try:
        while chunk := tls.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


def test_forbidden_address_never_gets_the_credential(cgw: Gateway) -> None:
    w = cgw.world
    authority = f"forbidden.test:{w.canary_port}"
    mark = w.canary.mark()
    tls, head = _tunnel(cgw, cgw.admit("cred-kv"), authority, "forbidden.test")
    # refused, and accepted to answer inside over the gateway's TLS (deny.connect_in_tunnel)
    assert tls is not None and b"address_forbidden" in head, head
    reply = _get(tls, authority)
    assert b" 403 " in reply.split(b"\r\n", 1)[0] and b"address_forbidden" in reply, reply
    assert KV_SECRET.encode() not in reply
    assert w.canary.since(mark) == []
    # positive control: where the policy permits 127.0.0.2, the canary receives the credential
    tls, head = _tunnel(cgw, cgw.admit("cred-canary-open"), authority, "forbidden.test")
    assert tls is not None, head
    assert b" 200 " in _get(tls, authority).split(b"\r\n", 1)[0]
    assert [h["auth"] for h in w.canary.since(mark)] == [[f"Bearer {KV_SECRET}"]]


def test_host_and_sni_mismatch_refused_before_injection(cgw: Gateway) -> None:
    w = cgw.world
    sbx = cgw.admit("cred-kv")
    api = f"api.test:{w.https_port}"
    mark = w.hits.mark()
    tls, _ = _tunnel(cgw, sbx, api, "api.test")
    assert tls is not None
    reply = _get(tls, f"other.test:{w.https_port}")  # Host names another (allowed) host
    assert reply.startswith(b"HTTP/1.1 421") and b"host_mismatch" in reply
    try:
        tls, _ = _tunnel(cgw, sbx, api, "other.test")  # SNI names another host
        reply = _get(tls, api) if tls is not None else b""
    except ssl.SSLError:
        reply = b""
    assert not reply.startswith(b"HTTP/1.1 200")
    assert w.hits.since(mark) == []  # no upstream saw anything, with or without a credential
    # positive control: consistent names get the credential
    tls, _ = _tunnel(cgw, sbx, api, "api.test")
    assert _get(tls, api).startswith(b"HTTP/1.1 200")
    assert last(cgw, mark, "api.test")["auth"] == [f"Bearer {KV_SECRET}"]


def test_absolute_form_https_without_tunnel_refused(cgw: Gateway) -> None:
    """`GET https://...` sent to the proxy in the clear (no CONNECT): the rule names a credential but the
    request is not inside an intercepted tunnel, so nothing is injected — the request is refused."""
    w = cgw.world
    sbx = cgw.admit("cred-kv")
    cred = base64.b64encode(f"{sbx['id']}:{sbx['token']}".encode()).decode()
    authority = f"api.test:{w.https_port}"
    mark = w.hits.mark()
    with socket.create_connection(cgw.proxy, timeout=10) as sock:
        sock.sendall(f"GET https://{authority}/echo HTTP/1.1\r\nHost: {authority}\r\n"
                     f"Proxy-Authorization: Basic {cred}\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 403"), reply[:300]
    assert b"credential_unavailable" in reply and KV_SECRET.encode() not in reply
    assert w.hits.since(mark) == []


def test_unknown_identity_gets_nothing(cgw: Gateway) -> None:
    w = cgw.world
    mark = w.hits.mark()
    tls, head = _tunnel(cgw, None, f"api.test:{w.https_port}", "api.test")
    assert tls is None and b" 407 " in head
    fake = {"id": "sbx-0000000000000000", "token": "nope"}
    tls, head = _tunnel(cgw, fake, f"api.test:{w.https_port}", "api.test")
    assert tls is None and b" 407 " in head
    assert w.hits.since(mark) == []


def test_http2_client_injected_and_scrubbed(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    mark = cgw.world.hits.mark()
    port = cgw.world.h2_port  # an h2-only upstream: mitmproxy offers the client what the upstream speaks
    with httpx.Client(proxy=sbx["proxy_url"], verify=ssl.create_default_context(cafile=cgw.bundle), http2=True,
                      timeout=15, trust_env=False) as c:
        r = c.get(cgw.url("api.test", "/h2/chunks", port=port), headers={"authorization": "Bearer mine"})
        r2 = c.get(cgw.url("api.test", "/h2/gzip", port=port))
    assert r.http_version == "HTTP/2" and r.status_code == 200
    assert last(cgw, mark, "api.test")["auth"] == [f"Bearer {KV_SECRET}"]
    assert KV_SECRET not in r.text and "[REDACTED]" in r.text and r.text.endswith("y" * 1000)
    assert r2.status_code == 200 and KV_SECRET not in r2.text and "[REDACTED]" in r2.text


async def _ws(gw: Gateway, sbx: dict, messages: list[str]) -> list[str]:
    ctx = ssl.create_default_context(cafile=gw.bundle)
    url = f"wss://other.test:{gw.world.https2_port}/ws"
    got: list[str] = []
    async with aiohttp.ClientSession(trust_env=False) as session, \
            session.ws_connect(url, proxy=sbx["proxy_url"], ssl=ctx) as ws:
        for m in messages:
            await ws.send_str(m)
            try:
                reply = await asyncio.wait_for(ws.receive(), 5)
            except TimeoutError:
                break
            if reply.type != aiohttp.WSMsgType.TEXT:
                break
            got.append(reply.data)
    return got


def test_websocket_scrubbed_and_phantom_message_cut(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    mark = cgw.world.hits.mark()
    got = asyncio.run(_ws(cgw, sbx, ["hello", "again"]))
    assert len(got) == 2 and all("auth=[REDACTED]" in g for g in got), got
    assert all(KV_SECRET not in g and base64.b64encode(KV_SECRET.encode()).decode() not in g for g in got)
    handshake = [h for h in cgw.world.hits.since(mark) if h["method"] == "GET" and h["path"] == "/ws"]
    assert [h["auth"] for h in handshake] == [[f"Bearer {KV_SECRET}"]]  # the handshake carried it
    phantom = cgw.admit("cred-phantom")["env"]["OPENAI_API_KEY"]
    mark = cgw.world.hits.mark()
    got = asyncio.run(_ws(cgw, sbx, ["first", f"key {phantom}", "after"]))
    assert len(got) == 1  # the phantom message was dropped and the connection cut
    assert [h["body"] for h in cgw.world.hits.since(mark) if h["method"] == "WSMSG"] == [b"first"]
    time.sleep(0.2)
    assert any(r.get("egressgate.reason") == "credential_misuse" and r.get("egressgate.sandbox.id") == sbx["id"]
               for r in cgw.audit_records())
