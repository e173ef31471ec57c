"""The byte paths of the transparent listener get every check of the explicit proxy: credential
injection and response scrubbing, phantom misuse, and the sandbox's outbound byte budget (one ledger
for both listeners).

How a connection becomes transparent here: a `nat output` rule (table egB_ctransparent<pid>, host netns)
DNATs TCP from 127.0.77.0/24 to the credential upstreams' ports on to the gateway's transparent
listener, exactly like a runtime's prerouting DNAT (SO_ORIGINAL_DST then names the upstream). Each test
admits a sandbox registered at its own 127.0.77.N source, and uses the same sandbox through the explicit
proxy as the positive control (same policy, same ledger, same upstreams).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import socket
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpcore
import httpx
import pytest

from tests.support.bao import KV_SECRET
from tests.support.credworld import TRANSPARENT_BUDGET, Gateway, hits_for, last
from tests.support.wsclient import CloseConnection, Ping, TextMessage, WsClient, open_tunnel

pytestmark = pytest.mark.netns  # root + nftables (a nat table in this namespace), like the netns tests

# one table per test session: the host namespace is shared, and a fixed name let a concurrent session's
# set-up/teardown delete this one's DNAT (its transparent connections then went straight to the upstream)
TABLE = f"egB_ctransparent{os.getpid()}"
SOURCES = (f"127.0.77.{n}" for n in itertools.count(10))


def _nft(*args: str, stdin: str | None = None, check: bool = True) -> None:
    subprocess.run(["nft", *args], input=stdin, text=True, check=check, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def tgw(cgw: Gateway) -> Iterator[Gateway]:
    info = json.loads((cgw.var / "gateway.json").read_text())
    host, _, port = info["transparent"].rpartition(":")
    w = cgw.world
    ports = ", ".join(str(p) for p in (w.https_port, w.https2_port, w.http_port, w.h2_port))
    _nft("delete", "table", "ip", TABLE, check=False)
    _nft("-f", "-", stdin=(
        f"table ip {TABLE} {{\n  chain out {{ type nat hook output priority -100; policy accept;\n"
        f"    ip saddr 127.0.77.0/24 ip daddr 127.0.0.1 tcp dport {{ {ports} }} dnat to {host}:{port}\n  }}\n}}\n"))
    try:
        yield cgw
    finally:
        _nft("delete", "table", "ip", TABLE, check=False)


@dataclass
class Both:
    """One sandbox, reachable over the transparent listener (its source address) and the explicit proxy."""

    gw: Gateway
    sbx: dict
    source: str

    def t_request(self, method: str, host: str, path: str, *, port: int | None = None, scheme: str = "https",
                  http2: bool = False, **kw) -> httpx.Response:
        """`method scheme://host:port/path` sent to 127.0.0.1 (DNATed), naming `host` in SNI and Host."""
        w = self.gw.world
        port = port or (w.https_port if scheme == "https" else w.http_port)
        headers = {"Host": f"{host}:{port}", **kw.pop("headers", {})}
        ctx = ssl.create_default_context(cafile=self.gw.bundle)
        transport = httpx.HTTPTransport(local_address=self.source, verify=ctx, http2=http2, http1=not http2)
        with httpx.Client(transport=transport, timeout=15, trust_env=False) as c:
            r = c.request(method, f"{scheme}://127.0.0.1:{port}{path}", headers=headers,
                          extensions={"sni_hostname": host} if scheme == "https" else {}, **kw)
        rec = transparent_record(self.gw, r)
        assert rec["egressgate.mode"] == "transparent" and rec["egressgate.sandbox.id"] == self.sbx["id"], rec
        return r

    def e_request(self, method: str, host: str, path: str, *, port: int | None = None, scheme: str = "https",
                  http2: bool = False, **kw) -> httpx.Response:
        transport = proxy_transport(self.sbx["proxy_url"], self.source,
                                    ssl.create_default_context(cafile=self.gw.bundle), http2)
        with httpx.Client(transport=transport, timeout=15, trust_env=False) as c:
            return c.request(method, self.gw.url(host, path, port=port, scheme=scheme), **kw)


class FromSource(httpcore.SyncBackend):
    """httpcore's sync network backend, every connection sent from one local address."""

    def __init__(self, source: str) -> None:
        self.source = source

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: object = None) -> httpcore.NetworkStream:
        return super().connect_tcp(host, port, timeout, self.source, socket_options)


def proxy_transport(proxy_url: str, source: str, ctx: ssl.SSLContext, http2: bool) -> httpx.HTTPTransport:
    """An httpx transport through the explicit proxy that connects FROM `source`: the sandbox's token is
    bound to its admitted address (identity_address_mismatch from anywhere else). httpx's and httpcore's
    proxy pools ignore `local_address`, so the pool gets a network backend that binds it."""
    transport = httpx.HTTPTransport(verify=ctx, http2=http2, http1=not http2)
    proxy = httpx.Proxy(proxy_url)
    transport._pool = httpcore.HTTPProxy(
        proxy_url=httpcore.URL(scheme=proxy.url.raw_scheme, host=proxy.url.raw_host, port=proxy.url.port,
                               target=proxy.url.raw_path),
        proxy_auth=proxy.raw_auth, ssl_context=ctx, http1=not http2, http2=http2, network_backend=FromSource(source))
    return transport


def admit(gw: Gateway) -> Both:
    source = next(SOURCES)
    res = httpx.post(f"http://{gw.admin}/v1/sandboxes", json={"policy": "cred-transparent", "addresses": [source]},
                     headers={"Authorization": f"Bearer {gw.token}"}, timeout=10, trust_env=False)
    assert res.status_code == 201, res.text
    return Both(gw, res.json(), source)


def transparent_record(gw: Gateway, resp: httpx.Response) -> dict:
    rid = resp.headers["x-egressgate-request-id"]
    records = [r for r in gw.audit_records() if r.get("egressgate.request.id") == rid]
    assert records, f"no audit record for {rid}"
    return records[-1]


def secret_forms() -> list[str]:
    return [KV_SECRET, base64.b64encode(KV_SECRET.encode()).decode(),
            base64.urlsafe_b64encode(KV_SECRET.encode()).decode().rstrip("=")]


# ------------------------------------------------------------------ the path is transparent (control)
def test_transparent_request_is_identified_by_source(tgw: Gateway) -> None:
    b = admit(tgw)
    mark = tgw.world.hits.mark()
    r = b.t_request("GET", "other.test", "/echo")
    assert r.status_code == 200, r.text
    assert last(tgw, mark, "other.test")["auth"] == []
    rec = transparent_record(tgw, r)
    assert rec["egressgate.sandbox.id"] == b.sbx["id"] and rec["egressgate.mode"] == "transparent"


# ------------------------------------------------------------------ credential injection + scrubbing
@pytest.mark.parametrize("mode", ["plain", "b64", "b64url", "json", "headers", "gzip", "gzip-chunks"])
@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_credential_injected_and_response_scrubbed(tgw: Gateway, path: str, mode: str) -> None:
    b = admit(tgw)
    mark = tgw.world.hits.mark()
    send = b.t_request if path == "transparent" else b.e_request
    r = send("GET", "api.test", f"/reflect/{mode}", headers={"Authorization": "Bearer sandbox-own"})
    assert r.status_code == 200, r.text
    assert last(tgw, mark, "api.test")["auth"] == [f"Bearer {KV_SECRET}"]  # injected, the sandbox's own replaced
    seen = r.text + repr(list(r.headers.multi_items())) + r.reason_phrase
    for form in secret_forms():
        assert form not in seen, f"{form!r} flowed back to the sandbox over the {path} path"


@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_http2_credential_injected_and_scrubbed(tgw: Gateway, path: str) -> None:
    """HTTP/2 to an h2-only upstream: the credential reaches it, its echo (split over DATA frames, or
    gzip-compressed) does not come back."""
    b = admit(tgw)
    send = b.t_request if path == "transparent" else b.e_request
    port = tgw.world.h2_port
    mark = tgw.world.hits.mark()
    r = send("GET", "api.test", "/h2/chunks", port=port, http2=True, headers={"Authorization": "Bearer mine"})
    assert r.http_version == "HTTP/2" and r.status_code == 200, r.text
    assert last(tgw, mark, "api.test")["auth"] == [f"Bearer {KV_SECRET}"]
    assert "[REDACTED]" in r.text and r.text.endswith("y" * 1000)
    r2 = send("GET", "api.test", "/h2/gzip", port=port, http2=True)
    assert r2.status_code == 200 and "[REDACTED]" in r2.text
    for form in secret_forms():
        assert form not in r.text + r2.text


@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_no_credential_over_plain_http(tgw: Gateway, path: str) -> None:
    """Plain HTTP (named by its Host on the transparent listener) never carries a credential, and a
    phantom in it is misuse on any route."""
    b = admit(tgw)
    send = b.t_request if path == "transparent" else b.e_request
    mark = tgw.world.hits.mark()
    r = send("GET", "api.test", "/echo", scheme="http", headers={"Authorization": "Bearer mine"})
    assert r.status_code == 200, r.text
    assert last(tgw, mark, "api.test")["auth"] == ["Bearer mine"]
    mark = tgw.world.hits.mark()
    r = send("GET", "api.test", "/echo", scheme="http", headers={"X-Key": b.sbx["env"]["OPENAI_API_KEY"]})
    assert r.status_code == 403 and r.json()["reason"] == "credential_misuse", r.text
    assert tgw.world.hits.since(mark) == []


# ------------------------------------------------------------------ phantom credentials
@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_phantom_swapped_only_on_its_route(tgw: Gateway, path: str) -> None:
    b = admit(tgw)
    phantom = b.sbx["env"]["OPENAI_API_KEY"]
    send = b.t_request if path == "transparent" else b.e_request
    mark = tgw.world.hits.mark()
    r = send("POST", "phantom.test", "/v1/chat", headers={"Authorization": f"Bearer {phantom}"}, json={"q": 1})
    assert r.status_code == 200, r.text
    assert last(tgw, mark, "phantom.test")["auth"] == [f"Bearer {KV_SECRET}"]
    for host, where in (("other.test", {"headers": {"Authorization": f"Bearer {phantom}"}}),
                        ("api.test", {"headers": {"X-Api-Key": phantom}}),
                        ("other.test", {"params": {"k": phantom}}),
                        ("phantom.test", {"headers": {"X-Other": phantom}})):
        mark = tgw.world.hits.mark()
        path_ = "/echo" if host != "phantom.test" else "/v1/x"
        r = send("GET", host, path_, **where)
        assert r.status_code == 403 and r.json()["reason"] == "credential_misuse", (host, where, r.text)
        assert tgw.world.hits.since(mark) == [], f"the upstream saw a misused phantom over the {path} path"


# ------------------------------------------------------------------ byte budgets
@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_upload_over_budget_is_refused(tgw: Gateway, path: str) -> None:
    b = admit(tgw)
    send = b.t_request if path == "transparent" else b.e_request
    mark = tgw.world.hits.mark()
    r = send("POST", "api.test", "/open/big", content=b"x" * (TRANSPARENT_BUDGET + 1))
    assert r.status_code == 429 and r.json()["reason"] == "budget_exceeded", r.text
    assert hits_for(tgw, mark, "api.test") == []
    r = send("POST", "api.test", "/open/small", content=b"x" * 100)  # control: nothing was spent
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_streamed_upload_over_budget_is_cut(tgw: Gateway, path: str) -> None:
    """A chunked body of unknown length: the chunk that would cross the budget is dropped and the
    connection cut, so the upstream never receives the whole body."""
    b = admit(tgw)
    send = b.t_request if path == "transparent" else b.e_request

    def body() -> Iterator[bytes]:
        for _ in range(40):
            yield b"y" * 1000

    mark = tgw.world.hits.mark()
    try:
        r = send("POST", "api.test", "/open/stream", content=body())
        status = r.status_code
    except httpx.HTTPError:
        status = None  # cut mid-body
    assert status in (None, 429, 502), status
    assert [h for h in hits_for(tgw, mark, "api.test") if len(h["body"]) >= 40000] == []


@pytest.mark.parametrize("first", ["explicit", "transparent"])
def test_one_ledger_for_both_listeners(tgw: Gateway, first: str) -> None:
    """Bytes sent over one listener count against the same sandbox's budget on the other."""
    b = admit(tgw)
    one, two = (b.e_request, b.t_request) if first == "explicit" else (b.t_request, b.e_request)
    half = TRANSPARENT_BUDGET * 6 // 10
    mark = tgw.world.hits.mark()
    assert one("POST", "api.test", "/open/a", content=b"a" * half).status_code == 200
    r = two("POST", "api.test", "/open/b", content=b"b" * half)
    assert r.status_code == 429 and r.json()["reason"] == "budget_exceeded", r.text
    assert [h["path"] for h in hits_for(tgw, mark, "api.test")] == ["/open/a"]


@pytest.mark.parametrize("first", ["explicit", "transparent"])
def test_rule_request_budget_shared_by_both_listeners(tgw: Gateway, first: str) -> None:
    """`api-quota` allows 2 requests per sandbox: one over each listener uses it up, for both."""
    b = admit(tgw)
    one, two = (b.e_request, b.t_request) if first == "explicit" else (b.t_request, b.e_request)
    mark = tgw.world.hits.mark()
    assert one("GET", "api.test", "/quota/1").status_code == 200
    assert two("GET", "api.test", "/quota/2").status_code == 200
    for send in (one, two):
        r = send("GET", "api.test", "/quota/3")
        assert r.status_code == 429 and r.json()["reason"] == "budget_exceeded", r.text
    assert [h["path"] for h in hits_for(tgw, mark, "api.test")] == ["/quota/1", "/quota/2"]


@pytest.mark.parametrize("first", ["explicit", "transparent"])
def test_rule_byte_budget_shared_by_both_listeners(tgw: Gateway, first: str) -> None:
    """`api-qbytes` allows 3000 bytes: 2000 over one listener leaves too little for 2000 over the other."""
    b = admit(tgw)
    one, two = (b.e_request, b.t_request) if first == "explicit" else (b.t_request, b.e_request)
    mark = tgw.world.hits.mark()
    assert one("POST", "api.test", "/qbytes/a", content=b"a" * 2000).status_code == 200
    r = two("POST", "api.test", "/qbytes/b", content=b"b" * 2000)
    assert r.status_code == 429 and r.json()["reason"] == "budget_exceeded", r.text
    assert [h["path"] for h in hits_for(tgw, mark, "api.test")] == ["/qbytes/a"]


# ------------------------------------------------------------------ WebSockets
def ws_open(b: Both, path: str, ws_path: str) -> WsClient:
    """A WebSocket to other.test on the credentialed `ws` route, over either listener."""
    port = b.gw.world.https2_port
    if path == "explicit":
        sock = open_tunnel(b.gw.proxy, b.sbx["id"], b.sbx["token"], f"other.test:{port}", b.gw.bundle, "other.test",
                           b.source)
    else:
        ctx = ssl.create_default_context(cafile=b.gw.bundle)
        raw = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(b.source, 0))
        sock = ctx.wrap_socket(raw, server_hostname="other.test")
    return WsClient(sock, f"other.test:{port}", ws_path)


def _opened(gw: Gateway, mark: int, ws_path: str) -> list[dict]:
    return [h for h in gw.world.hits.since(mark) if h["method"] == "GET" and h["path"] == ws_path]


@pytest.mark.parametrize("command", ["ping", "close"])
@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_websocket_credential_injected_and_control_frames_scrubbed(tgw: Gateway, path: str, command: str) -> None:
    b = admit(tgw)
    mark = tgw.world.hits.mark()
    ws = ws_open(b, path, "/wsctl")
    try:
        assert ws.send(TextMessage(command))
        kind = {"ping": Ping, "close": CloseConnection}[command]
        evs = ws.receive(5, until=lambda e: isinstance(e, kind))
        frames = [e for e in evs if isinstance(e, kind)]
        assert frames, evs
        got = frames[0].reason.encode() if command == "close" else bytes(frames[0].payload)
    finally:
        ws.close()
    assert [h["auth"] for h in _opened(tgw, mark, "/wsctl")] == [[f"Bearer {KV_SECRET}"]]
    assert got == b"auth=[REDACTED] b64=[REDACTED]", got


@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_websocket_messages_scrubbed_and_phantom_refused(tgw: Gateway, path: str) -> None:
    b = admit(tgw)
    mark = tgw.world.hits.mark()
    ws = ws_open(b, path, "/ws")
    try:
        assert ws.send(TextMessage("hello"))
        evs = ws.receive(5, until=lambda e: isinstance(e, TextMessage))
        texts = "".join(e.data for e in evs if isinstance(e, TextMessage))
        assert texts.startswith("echo hello"), evs
        for form in secret_forms():
            assert form not in texts, texts
        ws.send(TextMessage(f"leak {b.sbx['env']['OPENAI_API_KEY']}"))
        ws.receive(3, until=lambda e: isinstance(e, CloseConnection))
    finally:
        ws.close()
    msgs = [h["body"] for h in tgw.world.hits.since(mark) if h["method"] == "WSMSG"]
    assert msgs == [b"hello"], msgs  # the phantom never reached the upstream


@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_websocket_frames_count_against_the_budget(tgw: Gateway, path: str) -> None:
    """Frames are paid from the same ledger: a message that would cross the budget is not relayed."""
    b = admit(tgw)
    mark = tgw.world.hits.mark()
    ws = ws_open(b, path, "/ws")
    chunk = "z" * (TRANSPARENT_BUDGET // 2)
    try:
        assert ws.send(TextMessage("a" + chunk))
        ws.receive(5, until=lambda e: isinstance(e, TextMessage))
        ws.send(TextMessage("b" + chunk))  # may already fail: the gateway cuts the connection
        ws.receive(3, until=lambda e: isinstance(e, CloseConnection))
    finally:
        ws.close()
    msgs = [h["body"][:1] for h in tgw.world.hits.since(mark) if h["method"] == "WSMSG"]
    assert msgs == [b"a"], msgs


# ------------------------------------------------------------------ revocation mid-connection
def _tls_to(b: Both, path: str, host: str) -> ssl.SSLSocket:
    port = b.gw.world.https_port
    if path == "explicit":
        return open_tunnel(b.gw.proxy, b.sbx["id"], b.sbx["token"], f"{host}:{port}", b.gw.bundle, host, b.source)
    ctx = ssl.create_default_context(cafile=b.gw.bundle)
    raw = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(b.source, 0))
    return ctx.wrap_socket(raw, server_hostname=host)


def _exchange(sock: ssl.SSLSocket, host: str, path: str) -> bytes:
    """One keep-alive GET; the response head and Content-Length body ('' when the connection is cut)."""
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return head + b"\r\n\r\n" + body
    except OSError:
        return b""


@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_revocation_cuts_an_open_connection(tgw: Gateway, path: str) -> None:
    b = admit(tgw)
    mark = tgw.world.hits.mark()
    with _tls_to(b, path, "other.test") as sock:
        first = _exchange(sock, f"other.test:{tgw.world.https_port}", "/one")
        assert first.startswith(b"HTTP/1.1 200"), first[:300]
        res = httpx.delete(f"http://{tgw.admin}/v1/sandboxes/{b.sbx['id']}",
                           headers={"Authorization": f"Bearer {tgw.token}"}, timeout=10, trust_env=False)
        assert res.status_code in (200, 204), res.text
        second = _exchange(sock, f"other.test:{tgw.world.https_port}", "/two")
    assert second == b"" or b"sandbox_revoked" in second, second[:300]
    assert [h["path"] for h in hits_for(tgw, mark, "other.test")] == ["/one"]
