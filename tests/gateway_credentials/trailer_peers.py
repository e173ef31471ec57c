"""The peers of test_trailers.py: upstreams that record what they receive (HTTP/1 through h11 over TLS or
plain, HTTP/2 through the h2 state machine) and raw clients (a CONNECT tunnel + TLS, the explicit proxy in
plain HTTP, an h11 response parser, an h2 client that can send trailers)."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import ssl
import time
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import h11

from tests.support.credworld import Gateway
from tests.support.h2server import serve_h2_events
from tests.support.loopback import Hits


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
    streams: dict[int, dict] = {}

    async def on_event(conn, event) -> bool:
        if isinstance(event, h2.events.RequestReceived):
            d = dict(event.headers)
            streams[event.stream_id] = {"method": d.get(":method"), "path": d.get(":path"), "body_len": 0,
                                        "trailers": [], "headers": list(event.headers), "h2": True}
        elif isinstance(event, h2.events.DataReceived):
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
        return False

    def unfinished() -> None:  # a stream that never ended (EOF, reset connection, protocol error) is a hit too
        for req in streams.values():
            hits.add({**req, "complete": False})

    await serve_h2_events(reader, writer, on_event,
                          h2.config.H2Configuration(client_side=False, header_encoding="utf-8"),
                          errors=(ConnectionError, OSError, h2.exceptions.ProtocolError), on_close=unfinished)


@dataclass
class TWorld:
    gw: Gateway
    hits: Hits
    h1_port: int
    h2_port: int
    plain_port: int
    ca_pem: str


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
