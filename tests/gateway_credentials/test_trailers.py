"""Trailers and 1xx responses through the real gateway (issue 9, items 4 and 8).

Request trailers are refused (`trailers_not_allowed`) on every route: an HTTP/1 chunked request with a
trailer section, HTTP/2 trailers (48 kB over a 20 kB budget, a phantom placeholder in a trailer), buffered
or streamed. Response trailers are forwarded to HTTP/1 clients in the chunked terminator and scrubbed on
credentialed routes. A `103 Early Hints` before the real response is swallowed: the client gets the 200.

Own upstreams (h11 over TLS for HTTP/1, the h2 state machine for HTTP/2) record everything they receive,
including trailers and whether the request completed; the positive controls send the same requests
straight to them, proving they would have seen (and reflected) what the gateway must stop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import h11
import pytest
import yaml

from tests.broker.bao import KV_SECRET
from tests.gateway.conftest import Hits, stop_gateway

from .conftest import Gateway, World, launch

BUDGET = 20000
HOSTS = ("trailers.test", "credtrail.test", "phtrail.test")


# --------------------------------------------------------------------------------------- upstreams
def _credential(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name.lower() == b"authorization" and value.startswith(b"Bearer "):
            return value[7:].decode()
    return ""


async def serve_h1(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hits: Hits) -> None:
    """HTTP/1 upstream (h11): records method, path, body length, trailers, completion. Paths:
    /resp-trailers answers chunked with trailers echoing the credential; /early-hints sends 103 then 200;
    /many-1xx sends 40 informational responses; anything else answers 200 with what it saw."""
    conn = h11.Connection(h11.SERVER)
    req: dict = {}
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                if not data:
                    if req and not req.get("complete"):
                        hits.add({**req, "complete": False})
                    return
                conn.receive_data(data)
                continue
            if isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, h11.Request):
                req = {"method": event.method.decode(), "path": event.target.decode(), "body_len": 0,
                       "trailers": [], "headers": list(event.headers), "h2": False}
                if req["path"].endswith("/early-answer"):  # answer before reading the body
                    writer.write(conn.send(h11.Response(status_code=200, headers=[("Content-Length", "5")])))
                    writer.write(conn.send(h11.Data(data=b"early")))
                    writer.write(conn.send(h11.EndOfMessage()))
                    await writer.drain()
            elif isinstance(event, h11.Data):
                req["body_len"] += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                req["trailers"] = [(k.decode(), v.decode()) for k, v in event.headers]
                req["complete"] = True
                hits.add(dict(req))
                secret = _credential(req["headers"])
                path = req["path"]
                if path.endswith("/early-answer"):
                    pass  # answered already
                elif path == "/early-hints":
                    writer.write(conn.send(h11.InformationalResponse(
                        status_code=103, headers=[("Link", "</style.css>; rel=preload")])))
                    await writer.drain()
                    await asyncio.sleep(0.2)
                    writer.write(conn.send(h11.Response(status_code=200, headers=[("Content-Length", "5")])))
                    writer.write(conn.send(h11.Data(data=b"final")))
                    writer.write(conn.send(h11.EndOfMessage()))
                elif path == "/many-1xx":
                    for _ in range(40):
                        writer.write(conn.send(h11.InformationalResponse(status_code=102, headers=[])))
                    writer.write(conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")])))
                    writer.write(conn.send(h11.Data(data=b"ok")))
                    writer.write(conn.send(h11.EndOfMessage()))
                elif path == "/resp-trailers":
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        ("Content-Type", "text/plain"), ("Transfer-Encoding", "chunked"), ("Trailer", "X-Echo")])))
                    writer.write(conn.send(h11.Data(data=b"body-before-trailers")))
                    writer.write(conn.send(h11.EndOfMessage(headers=[
                        ("X-Echo", f"token={secret}"), ("X-Echo-B64", base64.b64encode(secret.encode()).decode()),
                        ("X-Plain", "ok")])))
                else:
                    body = json.dumps({"path": path, "body_len": req["body_len"],
                                       "trailers": len(req["trailers"])}).encode()
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        ("Content-Type", "application/json"), ("Content-Length", str(len(body)))])))
                    writer.write(conn.send(h11.Data(data=body)))
                    writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
                req = {}
    except (ConnectionError, OSError, h11.ProtocolError):
        if req and not req.get("complete"):
            hits.add({**req, "complete": False})
    finally:
        writer.close()


async def serve_h2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hits: Hits) -> None:
    """HTTP/2 upstream: records each stream's headers, body length, trailers, and whether it ended or was
    reset; /resp-trailers answers with trailers echoing the credential."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    streams: dict[int, dict] = {}
    try:
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    d = dict(event.headers)
                    streams[event.stream_id] = {"method": d.get(":method"), "path": d.get(":path"), "body_len": 0,
                                                "trailers": [], "headers": list(event.headers), "h2": True}
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    streams[event.stream_id]["body_len"] += len(event.data)
                elif isinstance(event, h2.events.TrailersReceived):
                    streams[event.stream_id]["trailers"] = list(event.headers)
                elif isinstance(event, h2.events.StreamReset):
                    if event.stream_id in streams:
                        hits.add({**streams.pop(event.stream_id), "complete": False})
                elif isinstance(event, h2.events.StreamEnded):
                    req = streams.pop(event.stream_id)
                    hits.add({**req, "complete": True})
                    secret = ""
                    for name, value in req["headers"]:
                        if name == "authorization" and value.startswith("Bearer "):
                            secret = value[7:]
                    if req["path"] == "/resp-trailers":
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "text/plain")])
                        conn.send_data(event.stream_id, b"body-before-trailers")
                        conn.send_headers(event.stream_id, [("x-echo", f"token={secret}"), ("x-plain", "ok")],
                                          end_stream=True)
                    else:
                        body = json.dumps({"path": req["path"], "body_len": req["body_len"]}).encode()
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-length", str(len(body)))])
                        conn.send_data(event.stream_id, body, end_stream=True)
            writer.write(conn.data_to_send())
            await writer.drain()
    except (ConnectionError, OSError, h2.exceptions.ProtocolError):
        pass
    finally:
        for req in streams.values():
            hits.add({**req, "complete": False})
        writer.close()


@dataclass
class TWorld:
    gw: Gateway
    hits: Hits
    h1_port: int
    h2_port: int
    plain_port: int
    ca_pem: str


@pytest.fixture(scope="module")
def tw(cworld: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TWorld]:
    tmp = tmp_path_factory.mktemp("trailers")
    cert = cworld.ca.issue_cert(*HOSTS)
    hits = Hits()
    servers: list = []

    async def start() -> tuple[int, int]:
        h1ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(h1ctx)
        h1ctx.set_alpn_protocols(["http/1.1"])
        h2ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(h2ctx)
        h2ctx.set_alpn_protocols(["h2"])
        s1 = await asyncio.start_server(lambda r, w: serve_h1(r, w, hits), "127.0.0.1", 0, ssl=h1ctx)
        s2 = await asyncio.start_server(lambda r, w: serve_h1(r, w, hits), "127.0.0.1", 0)  # plain HTTP
        s3 = await asyncio.start_server(lambda r, w: serve_h2(r, w, hits), "127.0.0.1", 0, ssl=h2ctx)
        servers.extend([s1, s2, s3])
        return tuple(s.sockets[0].getsockname()[1] for s in (s1, s2, s3))

    h1_port, plain_port, h2_port = cworld.loop.run(start())
    for host in HOSTS:
        cworld.dns.records[host] = "127.0.0.1"
    secret_file = tmp / "kv-secret"
    secret_file.write_text(KV_SECRET + "\n")
    os.chmod(secret_file, 0o600)
    static = {"type": "static", "source": {"file": str(secret_file)}, "ttl_seconds": 300}
    ports = [h1_port, h2_port]
    policy = {
        "sandbox": {"name": "trailers", "resources": {"outbound_bytes_max": BUDGET}},
        "network": {"allow_private": ["127.0.0.1/32"], "https": {"allow": [
            {"id": "plain", "host": "trailers.test", "ports": ports},
            {"id": "cred", "host": "credtrail.test", "ports": ports, "credential": "kv"},
            {"id": "phantom", "host": "phtrail.test", "ports": ports, "credential": "openai"},
        ]}, "http": {"allow": [{"id": "plain-http", "host": "trailers.test", "ports": [plain_port]}]}},
        "credentials": {"max_ttl_seconds": 120, "capabilities": {
            "kv": static,
            "openai": {**static, "mode": "phantom", "phantom_env": "OPENAI_API_KEY",
                       "placement": {"header": "Authorization", "format": "Bearer {value}"}}}},
    }
    (tmp / "policies").mkdir()
    (tmp / "policies" / "trailers.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
    gw = launch(cworld, tmp, None, broker={}, file_secret=str(secret_file))
    try:
        yield TWorld(gw=gw, hits=hits, h1_port=h1_port, h2_port=h2_port, plain_port=plain_port,
                     ca_pem=str(tmp / "upstream-ca.pem"))
    finally:
        stop_gateway(gw)  # type: ignore[arg-type]

        async def stop() -> None:
            for server in servers:
                server.close()
        cworld.loop.run(stop())


# --------------------------------------------------------------------------------------- clients
def tunnel_tls(tw: TWorld, sbx: dict | None, host: str, port: int, alpn: str) -> ssl.SSLSocket:
    """CONNECT through the gateway (sbx) or straight to the upstream (None), then TLS with `alpn`."""
    if sbx is None:
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        ctx = ssl.create_default_context(cafile=tw.ca_pem)
    else:
        raw = socket.create_connection(tw.gw.proxy, timeout=10)
        auth = base64.b64encode(f"{sbx['id']}:{sbx['token']}".encode()).decode()
        raw.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = raw.recv(4096)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head
        ctx = ssl.create_default_context(cafile=tw.gw.bundle)
    ctx.set_alpn_protocols([alpn])
    tls = ctx.wrap_socket(raw, server_hostname=host)
    tls.settimeout(10)
    return tls


def proxy_plain(tw: TWorld, sbx: dict | None) -> socket.socket:
    """A plain connection to the explicit proxy (sbx) or straight to the plain upstream (None)."""
    sock = socket.create_connection(tw.gw.proxy if sbx is not None else ("127.0.0.1", tw.plain_port), timeout=10)
    sock.settimeout(10)
    return sock


def proxy_auth(sbx: dict) -> str:
    return "Proxy-Authorization: Basic " + base64.b64encode(f"{sbx['id']}:{sbx['token']}".encode()).decode()


@dataclass
class H1Result:
    status: int
    headers: dict
    body: bytes
    trailers: dict
    raw: bytes
    informational: list


def h1_exchange(tls: socket.socket, request: bytes, timeout: float = 10) -> H1Result:
    """Send raw bytes, parse the answer with h11 (1xx, chunked body and trailers included). A connection
    that stays silent past `timeout` is a hang: status 0."""
    tls.sendall(request)
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))  # state only; bytes unused
    client.send(h11.EndOfMessage())
    status, headers, body, trailers, raw, info = 0, {}, b"", {}, b"", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = client.next_event()
        if event is h11.NEED_DATA:
            try:
                data = tls.recv(65536)
            except (TimeoutError, ssl.SSLError, OSError):
                break
            raw += data
            client.receive_data(data)
            if not data:
                break
            continue
        if isinstance(event, h11.InformationalResponse):
            info.append(event.status_code)
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode().lower(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            trailers = {k.decode().lower(): v.decode() for k, v in event.headers}
            break
        elif isinstance(event, h11.ConnectionClosed):
            break
    return H1Result(status, headers, body, trailers, raw, info)


def chunked_request(host: str, path: str, body: bytes, trailer_lines: list[str]) -> bytes:
    trailer = "".join(f"{line}\r\n" for line in trailer_lines).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
            f"Content-Type: text/plain\r\n\r\n").encode() + b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailer)


@dataclass
class H2Result:
    status: int | str
    headers: dict
    body: bytes
    trailers: dict


def h2_exchange(tls: ssl.SSLSocket, host: str, path: str, body: bytes = b"", trailers: list | None = None,
                content_length: bool = False, timeout: float = 10) -> H2Result:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 1 << 20})
    headers = [(":method", "POST" if body or trailers else "GET"), (":scheme", "https"), (":authority", host),
               (":path", path)]
    if content_length:
        headers.append(("content-length", str(len(body))))
    conn.send_headers(1, headers, end_stream=not (body or trailers))
    for i in range(0, len(body), 16000):
        conn.send_data(1, body[i:i + 16000], end_stream=not trailers and i + 16000 >= len(body))
    if trailers:
        conn.send_headers(1, trailers, end_stream=True)
    tls.sendall(conn.data_to_send())
    result = H2Result("none", {}, b"", {})
    deadline = time.monotonic() + timeout
    done = False
    while not done and time.monotonic() < deadline:
        try:
            data = tls.recv(65536)
        except (TimeoutError, ssl.SSLError, OSError):
            break
        if not data:
            result.status = result.status if result.status != "none" else "closed"
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                result.headers = dict(event.headers)
                result.status = int(result.headers[":status"])
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                result.body += event.data
            elif isinstance(event, h2.events.TrailersReceived):
                result.trailers = dict(event.headers)
            elif isinstance(event, h2.events.StreamEnded):
                done = True
            elif isinstance(event, h2.events.StreamReset):
                result.status = "reset" if result.status == "none" else result.status
                done = True
        out = conn.data_to_send()
        if out:
            tls.sendall(out)
    return result


def deny_reason(body: bytes) -> str | None:
    try:
        return json.loads(body).get("reason")
    except ValueError:
        return None


def records_for(gw: Gateway, sbx: dict) -> list[dict]:
    return [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sbx["id"]]


def settle() -> None:
    time.sleep(0.3)


BIG_TRAILERS = [(f"x-exfil-{i}", "A" * 4000) for i in range(12)]  # 48 kB of trailer fields


# --------------------------------------------------------------------------------------- request trailers, HTTP/1
def test_h1_chunked_request_trailers_refused(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    request = chunked_request("trailers.test", "/upload", b"hello", ["X-Exfil: secret-data", "X-More: 2"])
    # positive control: straight to the upstream, the trailers arrive
    mark = tw.hits.mark()
    direct = h1_exchange(tunnel_tls(tw, None, "trailers.test", tw.h1_port, "http/1.1"), request)
    assert direct.status == 200
    assert tw.hits.since(mark)[-1]["trailers"] == [("x-exfil", "secret-data"), ("x-more", "2")]
    # through the gateway: a deny the client sees, and the upstream never gets a complete request
    mark = tw.hits.mark()
    res = h1_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1"), request)
    assert res.status == 403, res
    assert res.headers.get("x-egressgate-decision") == "deny"
    assert deny_reason(res.body) == "trailers_not_allowed", res.body
    settle()
    seen = tw.hits.since(mark)
    assert all(not r.get("complete") and not r["trailers"] for r in seen), seen
    denies = [r for r in records_for(tw.gw, sbx) if r.get("egressgate.reason") == "trailers_not_allowed"]
    assert len(denies) == 1 and denies[0]["egressgate.decision"] == "deny"
    assert "secret-data" not in tw.gw.audit_text()


def test_h1_chunked_request_without_trailers_still_passes(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    res = h1_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1"),
                      chunked_request("trailers.test", "/upload", b"hello", []))
    assert res.status == 200 and json.loads(res.body)["body_len"] == 5, res
    settle()
    assert [r["complete"] for r in tw.hits.since(mark)] == [True]


@pytest.mark.parametrize("piecewise", [False, True])
def test_h1_oversized_trailer_section_is_a_clean_error(tw: TWorld, piecewise: bool) -> None:
    """A trailer block past 64 KiB is neither buffered nor forwarded: whether it arrives in one read or
    trickles in, the client gets a 400 (never a hang) and the upstream never sees the request complete."""
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    lines = [f"X-Fill-{i}: {'B' * 1000}" for i in range(80)]
    request = chunked_request("trailers.test", "/upload", b"hello", lines)
    tls = tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1")
    if piecewise:
        with contextlib.suppress(OSError):  # the gateway answers and closes before the end arrives
            for i in range(0, len(request) - 8000, 8000):
                tls.sendall(request[i:i + 8000])
                time.sleep(0.02)
        request = b""
    res = h1_exchange(tls, request)
    assert res.status == 400 and b"trailer section larger than" in res.body, res
    settle()
    assert all(not r.get("complete") for r in tw.hits.since(mark))


def test_h1_trailers_refused_on_plain_http_through_the_explicit_proxy(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    target = f"http://trailers.test:{tw.plain_port}/upload"
    request = chunked_request("trailers.test", target, b"hello", ["X-Exfil: plain"])
    request = request.replace(b"\r\nHost:", f"\r\n{proxy_auth(sbx)}\r\nHost:".encode(), 1)
    mark = tw.hits.mark()
    res = h1_exchange(proxy_plain(tw, sbx), request)
    assert res.status == 403 and deny_reason(res.body) == "trailers_not_allowed", res
    settle()
    assert all(not r.get("complete") and not r["trailers"] for r in tw.hits.since(mark))
    # positive control: without trailers the same request is forwarded
    res = h1_exchange(proxy_plain(tw, sbx), chunked_request("trailers.test", target, b"hello", []).replace(
        b"\r\nHost:", f"\r\n{proxy_auth(sbx)}\r\nHost:".encode(), 1))
    assert res.status == 200 and json.loads(res.body)["body_len"] == 5, res


def test_h1_trailers_after_an_early_upstream_answer_never_reach_it(tw: TWorld) -> None:
    """The upstream answers before the body ends; the trailers that follow are still refused (audited)
    and never forwarded: the request is reset rather than completed."""
    sbx = tw.gw.admit("trailers")
    head = (b"POST /early-answer HTTP/1.1\r\nHost: trailers.test\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n")
    tls = tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1")
    mark = tw.hits.mark()
    tls.sendall(head)
    time.sleep(0.5)  # the upstream's early answer is on its way to the client
    with contextlib.suppress(OSError):
        tls.sendall(b"0\r\nX-Exfil: late\r\n\r\n")
    with contextlib.suppress(OSError, TimeoutError):
        tls.recv(65536)
    settle()
    seen = tw.hits.since(mark)
    assert [(r["body_len"], r["complete"], r["trailers"]) for r in seen] == [(5, False, [])], seen  # cut, not completed
    assert any(r.get("egressgate.reason") == "trailers_not_allowed" for r in records_for(tw.gw, sbx))


# --------------------------------------------------------------------------------------- request trailers, HTTP/2
def test_h2_trailers_48k_over_budget_refused(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    # positive control: straight to the upstream, 48 kB of trailers arrive
    mark = tw.hits.mark()
    direct = h2_exchange(tunnel_tls(tw, None, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                         b"hello", BIG_TRAILERS)
    assert direct.status == 200
    assert sum(len(v) for _k, v in tw.hits.since(mark)[-1]["trailers"]) == 48000
    mark = tw.hits.mark()
    res = h2_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                      b"hello", BIG_TRAILERS)
    assert res.status == 403 and deny_reason(res.body) == "trailers_not_allowed", res
    settle()
    seen = tw.hits.since(mark)
    assert all(not r["complete"] and not r["trailers"] for r in seen), seen


def test_h2_phantom_in_trailer_refused(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    phantom = sbx["env"]["OPENAI_API_KEY"]
    assert phantom.startswith("egph_")
    trailers = [("authorization", f"Bearer {phantom}"), ("x-note", phantom)]
    mark = tw.hits.mark()
    res = h2_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                      b"payload", trailers)
    assert res.status == 403 and deny_reason(res.body) == "trailers_not_allowed", res
    settle()
    seen = tw.hits.since(mark)
    assert all(phantom not in repr(r) and not r["complete"] for r in seen), seen
    assert phantom not in tw.gw.audit_text()
    # positive control: the same phantom as the bound header on its own route is swapped and passes
    mark = tw.hits.mark()
    ok = h2_exchange(tunnel_tls(tw, sbx, "phtrail.test", tw.h2_port, "h2"), "phtrail.test", "/echo")
    assert ok.status == 200, ok
    assert tw.hits.since(mark)[-1]["complete"]


def test_h2_buffered_body_with_trailers_refused_and_refunded(tw: TWorld) -> None:
    """Content-Length <= 64 KiB: the body is buffered, nothing goes upstream, the prepaid bytes return."""
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    res = h2_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                      b"x" * 3000, [("x-exfil", "1")], content_length=True)
    assert res.status == 403 and deny_reason(res.body) == "trailers_not_allowed", res
    settle()
    assert tw.hits.since(mark) == []
    # positive control, and the refund: 17 kB more only fit the 20 kB budget if the refused 3 kB came back
    res = h2_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                      b"x" * 17000, None, content_length=True)
    assert res.status == 200 and json.loads(res.body)["body_len"] == 17000, res


# --------------------------------------------------------------------------------------- response trailers
def test_h1_response_trailers_forwarded(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    res = h1_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1"),
                      b"GET /resp-trailers HTTP/1.1\r\nHost: trailers.test\r\n\r\n")
    assert res.status == 200 and res.body == b"body-before-trailers", res
    assert res.trailers.get("x-plain") == "ok", res


def test_h1_response_trailer_echoing_credential_is_scrubbed(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    res = h1_exchange(tunnel_tls(tw, sbx, "credtrail.test", tw.h1_port, "http/1.1"),
                      b"GET /resp-trailers HTTP/1.1\r\nHost: credtrail.test\r\n\r\n")
    # positive control: the upstream got the credential, so its trailers did carry it
    assert (b"authorization", f"Bearer {KV_SECRET}".encode()) in tw.hits.since(mark)[-1]["headers"]
    assert res.status == 200 and res.body == b"body-before-trailers", res
    assert res.trailers.get("x-plain") == "ok" and "x-echo" in res.trailers, res
    for form in (KV_SECRET, base64.b64encode(KV_SECRET.encode()).decode().rstrip("=")):
        assert form.encode() not in res.raw, res.trailers


def test_h2_response_trailer_echoing_credential_is_scrubbed(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    res = h2_exchange(tunnel_tls(tw, sbx, "credtrail.test", tw.h2_port, "h2"), "credtrail.test", "/resp-trailers")
    assert any(v == f"Bearer {KV_SECRET}" for _k, v in tw.hits.since(mark)[-1]["headers"])
    assert res.status == 200 and res.trailers.get("x-plain") == "ok", res
    assert KV_SECRET not in repr(res.trailers), res.trailers


# --------------------------------------------------------------------------------------- 1xx
def test_early_hints_then_final_response(tw: TWorld) -> None:
    request = b"GET /early-hints HTTP/1.1\r\nHost: trailers.test\r\n\r\n"
    # positive control: the upstream really sends a 103 before the 200
    direct = h1_exchange(tunnel_tls(tw, None, "trailers.test", tw.h1_port, "http/1.1"), request)
    assert direct.informational == [103] and direct.status == 200
    sbx = tw.gw.admit("trailers")
    tls = tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1")
    res = h1_exchange(tls, request)
    assert res.status == 200 and res.body == b"final", res
    # the connection stays usable for the next request
    again = h1_exchange(tls, b"GET /echo HTTP/1.1\r\nHost: trailers.test\r\n\r\n")
    assert again.status == 200, again


def test_early_hints_over_plain_http_through_the_explicit_proxy(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    target = f"http://trailers.test:{tw.plain_port}/early-hints"
    direct = h1_exchange(proxy_plain(tw, None), b"GET /early-hints HTTP/1.1\r\nHost: trailers.test\r\n\r\n")
    assert direct.informational == [103] and direct.status == 200
    res = h1_exchange(proxy_plain(tw, sbx),
                      f"GET {target} HTTP/1.1\r\nHost: trailers.test\r\n{proxy_auth(sbx)}\r\n\r\n".encode())
    assert res.status == 200 and res.body == b"final" and res.informational == [], res


def test_endless_informational_responses_end_in_502(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    res = h1_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1"),
                      b"GET /many-1xx HTTP/1.1\r\nHost: trailers.test\r\n\r\n")
    assert res.status == 502, res
