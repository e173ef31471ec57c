"""Phantom mode: the sandbox holds a worthless placeholder; the gateway swaps it for the real value
only in the configured header of the bound route, and denies it anywhere else (credential_misuse)."""

from __future__ import annotations

import socket
import ssl
import time
from urllib.parse import quote

import httpx

from tests.support.bao import KV_SECRET
from tests.support.credworld import Gateway, hits_for, last


def phantom_sandbox(gw: Gateway) -> tuple[dict, str]:
    sbx = gw.admit("cred-phantom")
    phantom = sbx["env"]["OPENAI_API_KEY"]
    assert phantom.startswith("egph_") and len(phantom) == 53
    return sbx, phantom


def test_admission_hands_only_a_phantom(cgw: Gateway) -> None:
    sbx, phantom = phantom_sandbox(cgw)
    _other, other_phantom = phantom_sandbox(cgw)
    assert phantom != other_phantom
    assert KV_SECRET not in repr(sbx) and phantom not in cgw.audit_text()
    assert "OPENAI_API_KEY" not in cgw.admit("cred-kv")["env"]  # only phantom-mode capabilities


def test_admission_refuses_phantom_env_over_proxy_variables(cgw: Gateway) -> None:
    res = httpx.post(f"http://{cgw.admin}/v1/sandboxes", json={"policy": "cred-clash"},
                     headers={"Authorization": f"Bearer {cgw.token}"}, timeout=10, trust_env=False)
    assert res.status_code == 409 and "HTTPS_PROXY" in res.json()["message"]


def test_phantom_swapped_on_bound_route(cgw: Gateway) -> None:
    sbx, phantom = phantom_sandbox(cgw)
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        r = c.post(cgw.url("phantom.test", "/v1/chat"), headers={"Authorization": f"Bearer {phantom}"},
                   json={"prompt": "hi"})
    assert r.status_code == 200, r.text
    assert last(cgw, mark, "phantom.test")["auth"] == [f"Bearer {KV_SECRET}"]
    # without the phantom nothing is injected (and nothing of the sandbox's own goes through either)
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        assert c.get(cgw.url("phantom.test", "/v1/models"), headers={"Authorization": "Bearer x"}).status_code == 200
    assert last(cgw, mark, "phantom.test")["auth"] == []


def _misuse(cgw: Gateway, sbx: dict, method: str, url: str, **kw) -> None:
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        r = c.request(method, url, **kw)
    assert r.status_code == 403, (url, r.status_code, r.text)
    assert r.json()["reason"] == "credential_misuse", r.text
    assert cgw.world.hits.since(mark) == [], "the upstream must not see a misused phantom"


def test_each_misuse_denied_with_positive_controls(cgw: Gateway) -> None:
    sbx, phantom = phantom_sandbox(cgw)
    _, foreign = phantom_sandbox(cgw)
    auth = {"Authorization": f"Bearer {phantom}"}
    u = cgw.url
    cases = [
        ("GET", u("other.test", "/echo"), {"headers": auth}),  # another host
        ("GET", u("phantom.test", "/open"), {"headers": auth}),  # same host, route without the capability
        ("GET", u("phantom.test", f"/v1/x?key={phantom}"), {"headers": auth}),  # the query
        ("GET", u("phantom.test", f"/v1/x?key={quote(phantom.upper())}"), {}),  # encoded / upper-case
        ("GET", u("phantom.test", f"/v1/{phantom}"), {}),  # the path
        ("GET", u("phantom.test", "/v1/" + "".join(f"%{b:02X}" for b in phantom.encode())), {}),  # all encoded
        ("GET", u("phantom.test", "/v1/x"), {"headers": {f"X-{phantom}": "1"}}),  # a header *name*
        ("GET", u("phantom.test", "/v1/x"), {"headers": {"X-Api-Key": phantom}}),  # another header
        ("POST", u("phantom.test", "/v1/x"), {"headers": auth, "content": b"k=" + phantom.encode()}),  # body
        ("GET", u("phantom.test", "/v1/x"), {"headers": {"Authorization": f"Bearer {foreign}"}}),  # not ours
        ("GET", u("other.test", "/echo"), {"headers": {"Cookie": f"k={phantom}"}}),
    ]
    for method, url, kw in cases:
        _misuse(cgw, sbx, method, url, **kw)
    # positive controls: the same requests without the phantom reach the upstream
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        assert c.get(u("other.test", "/echo"), headers={"Authorization": "Bearer x"}).status_code == 200
        assert c.get(u("phantom.test", "/v1/x?key=1"), headers=auth).status_code == 200
        assert c.post(u("phantom.test", "/v1/x"), headers=auth, content=b"k=v").status_code == 200
    assert len(cgw.world.hits.since(mark)) == 3
    records = [r for r in cgw.audit_records() if r.get("egressgate.sandbox.id") == sbx["id"]
               and r.get("egressgate.reason") == "credential_misuse"]
    assert len(records) == len(cases)
    assert phantom not in cgw.audit_text() and phantom.upper() not in cgw.audit_text()


def _stream_post(gw: Gateway, sbx: dict, chunks: list[bytes]) -> bytes:
    """POST a chunked body through a raw tunnel, one chunk per send (so the gateway sees real splits)."""
    import base64

    sock = socket.create_connection(gw.proxy, timeout=10)
    host = f"phantom.test:{gw.world.https_port}"
    cred = base64.b64encode(f"{sbx['id']}:{sbx['token']}".encode()).decode()
    sock.sendall(f"CONNECT {host} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: Basic {cred}\r\n\r\n".encode())
    assert b" 200 " in sock.recv(4096)
    tls = ssl.create_default_context(cafile=gw.bundle).wrap_socket(sock, server_hostname="phantom.test")
    tls.sendall(f"POST /v1/upload HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    for chunk in chunks:
        try:
            tls.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            break
        time.sleep(0.05)
    try:
        tls.sendall(b"0\r\n\r\n")
        tls.settimeout(5)
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                break
    except OSError:
        data = b""
    tls.close()
    return data


def test_phantom_in_streamed_body_split_across_chunks(cgw: Gateway) -> None:
    sbx, phantom = phantom_sandbox(cgw)
    p = phantom.encode()
    mark = cgw.world.hits.mark()
    reply = _stream_post(cgw, sbx, [b"a" * 100, b'{"key":"' + p[:20], p[20:], b'"}', b"z" * 10])
    assert b" 200 " not in reply.split(b"\r\n", 1)[0]
    # the sandbox reads why (before: a reset): the upstream request is aborted, the client answered
    assert reply.startswith(b"HTTP/1.1 403") and b"x-egressgate-decision: deny" in reply.lower(), reply[:300]
    time.sleep(0.3)
    for hit in hits_for(cgw, mark, "phantom.test"):
        assert p not in hit["body"] and p[:20] not in hit["body"]  # not even the first half got out
    records = [r for r in cgw.audit_records() if r.get("egressgate.sandbox.id") == sbx["id"]
               and r.get("egressgate.reason") == "credential_misuse"]
    assert records, "a streamed misuse is audited"
    # positive control: the same stream without the phantom arrives whole
    mark = cgw.world.hits.mark()
    reply = _stream_post(cgw, sbx, [b"a" * 100, b'{"key":"' + b"q" * 20, b"r" * 33, b'"}', b"z" * 10])
    assert b" 200 " in reply.split(b"\r\n", 1)[0], reply[:200]
    body = last(cgw, mark, "phantom.test")["body"]
    assert body == b"a" * 100 + b'{"key":"' + b"q" * 20 + b"r" * 33 + b'"}' + b"z" * 10
