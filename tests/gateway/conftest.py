"""Loopback world for the gateway tests: real upstreams (TLS via trustme), a test DNS server, and the
real gateway started as `egressgate run --config ...` on port 0.

Everything is session-scoped (the gateway, its CA and the servers start once, ~2 s) and tests stay
independent by admitting a fresh sandbox per test: budgets, identity and revocation are per sandbox.
Destinations: names under `.test` resolve (through our DNS server only) to 127.0.0.1, where the
upstreams listen; the *canary* listens on 127.0.0.2, which every policy except `canary-open` forbids
(`allow_private: [127.0.0.1/32]`), so a gateway bug shows up as a canary hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import trustme
import yaml
from aiohttp import web
from dnslib import QTYPE, RR, A, DNSRecord

EGRESSGATE = str(Path(sys.executable).with_name("egressgate"))
NAMES = ["untrusted.test", "badname.test", "h2.test", "api.test", "other.test", "sse.test", "tcp.test",
         "open.test", "nohost.test"]
UNCERTIFIED = ("untrusted.test", "badname.test")  # the test CA's certificate does not name these


# --------------------------------------------------------------------------------------- servers
@dataclass
class Hits:
    """What each upstream saw (the canary's list must stay empty in deny tests)."""

    requests: list[dict] = field(default_factory=list)
    tcp: list[bytes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, item: dict) -> None:
        with self.lock:
            self.requests.append(item)

    def mark(self) -> int:
        return len(self.requests)

    def since(self, mark: int) -> list[dict]:
        with self.lock:
            return list(self.requests[mark:])


class LoopThread:
    """An asyncio loop in a daemon thread for the servers (the tests themselves are synchronous)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def make_app(hits: Hits, sse_release: dict) -> web.Application:
    async def record(request: web.Request) -> bytes:
        body = b""
        total = 0
        async for chunk in request.content.iter_any():
            total += len(chunk)
            if len(body) < 4096:
                body += chunk[: 4096 - len(body)]
        hits.add({
            "method": request.method, "path": request.path_qs, "host": request.headers.get("Host"),
            "headers": {k.lower(): v for k, v in request.headers.items()}, "body_len": total,
            "body_head": body.decode("latin-1"), "complete": True,
            "peer": request.transport.get_extra_info("peername") if request.transport else None,
        })
        return body

    async def echo(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"method": request.method, "path": request.path_qs,
                                  "headers": {k.lower(): v for k, v in request.headers.items()}})

    async def big(request: web.Request) -> web.StreamResponse:
        await record(request)
        size = int(request.query.get("n", "200000"))
        resp = web.StreamResponse()
        resp.content_length = size
        await resp.prepare(request)
        chunk = b"x" * 65536
        sent = 0
        while sent < size:
            part = chunk[: min(len(chunk), size - sent)]
            await resp.write(part)
            sent += len(part)
        await resp.write_eof()
        return resp

    async def sse(request: web.Request) -> web.StreamResponse:
        await record(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        key = request.query.get("key", "default")
        event = sse_release.setdefault(key, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), 10)
        await resp.write(b"data: last\n\n")
        await resp.write_eof()
        return resp

    async def redirect(request: web.Request) -> web.Response:
        await record(request)
        raise web.HTTPFound(request.query.get("to", "https://other.test/echo"))

    async def ws(request: web.Request) -> web.WebSocketResponse:
        hits.add({"method": "WS", "path": request.path, "host": request.headers.get("Host")})
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for msg in sock:
            hits.add({"method": "WSMSG", "path": request.path, "len": len(msg.data)})
            await sock.send_str(f"echo:{len(msg.data)}")
        return sock

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/big", big)
    app.router.add_get("/sse", sse)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/ws", ws)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


async def serve_h2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hits: Hits) -> None:
    """A minimal HTTP/2-only upstream (h2 state machine over asyncio) so the client side negotiates h2
    through the gateway (mitmproxy mirrors the upstream's ALPN)."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    streams: dict[int, dict] = {}
    try:
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    streams[event.stream_id] = {k.decode(): v.decode() for k, v in event.headers}
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    req = streams.pop(event.stream_id, {})
                    hits.add({"method": req.get(":method"), "path": req.get(":path"),
                              "host": req.get(":authority"), "headers": req, "body_len": 0, "h2": True})
                    if req.get(":path") == "/ok/upstream-continuation-flood":
                        writer.write(conn.data_to_send())
                        hits.add(await continuation_flood(reader, writer, event.stream_id))
                        return
                    body = json.dumps({"path": req.get(":path"), "h2": True}).encode()
                    conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "application/json"),
                                                        ("content-length", str(len(body)))])
                    conn.send_data(event.stream_id, body, end_stream=True)
            writer.write(conn.data_to_send())
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def continuation_flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream_id: int,
                             frames: int = 80, frame_bytes: int = 16000) -> dict:
    """A hostile HTTP/2 upstream: a response HEADERS frame without END_HEADERS, then CONTINUATION
    frames one at a time, each followed by 0.2 s to see whether the gateway reacted (GOAWAY, RST_STREAM
    or EOF). Returns how many frames went out before it did: the bound is in the gateway's reaction, not
    in the kernel's socket buffers."""
    from hyperframe.frame import ContinuationFrame, HeadersFrame

    headers = HeadersFrame(stream_id, data=b"\x88")  # ":status: 200", and no END_HEADERS
    writer.write(headers.serialize())
    seen = b""
    for sent in range(1, frames + 1):
        writer.write(ContinuationFrame(stream_id, data=b"\x00" * frame_bytes).serialize())
        try:
            await writer.drain()
            data = await asyncio.wait_for(reader.read(65536), 0.2)
        except TimeoutError:
            continue
        except (ConnectionError, OSError):
            data = b""
        seen += data
        if not data or _has_frame(seen, (0x3, 0x7)):  # EOF, RST_STREAM or GOAWAY
            return {"path": "upstream-flood-result", "frames": sent, "bytes": sent * frame_bytes}
    return {"path": "upstream-flood-result", "frames": frames, "bytes": frames * frame_bytes, "ignored": True}


def _has_frame(data: bytes, types: tuple[int, ...]) -> bool:
    """Whether the HTTP/2 frames in `data` (no preface) include one of `types`."""
    at = 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at:at + 3], "big")
        if data[at + 3] in types:
            return True
        at += 9 + length
    return False


class DnsServer(asyncio.DatagramProtocol):
    """Answers A queries from `records`; `flip` names alternate between two answers with TTL 0."""

    def __init__(self) -> None:
        self.records: dict[str, str] = {}
        self.flip: dict[str, list[str]] = {}
        self.counts: dict[str, int] = {}
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        request = DNSRecord.parse(data)
        reply = request.reply()
        q = request.q
        name = str(q.qname).rstrip(".").lower()
        if q.qtype == QTYPE.A:
            self.counts[name] = self.counts.get(name, 0) + 1
            if name in self.flip:
                answers = self.flip[name]
                ip = answers[(self.counts[name] - 1) % len(answers)]
                reply.add_answer(RR(q.qname, QTYPE.A, rdata=A(ip), ttl=0))
            elif name in self.records:
                value = self.records[name]
                for ip in [value] if isinstance(value, str) else value:
                    reply.add_answer(RR(q.qname, QTYPE.A, rdata=A(ip), ttl=0))
            else:
                reply.header.rcode = 3
        elif name not in self.records and name not in self.flip:
            reply.header.rcode = 3
        self.transport.sendto(reply.pack(), addr)


@dataclass
class World:
    tmp: Path
    ca: trustme.CA
    https_port: int
    h2_port: int
    untrusted_port: int
    evil_port: int
    blackhole_port: int
    http_port: int
    tcp_port: int
    canary_https_port: int
    hits: Hits
    canary: Hits
    dns: DnsServer
    dns_port: int
    loop: LoopThread
    sse_release: dict
    snis: list

    def release_sse(self, key: str) -> None:
        async def _set():
            self.sse_release.setdefault(key, asyncio.Event()).set()
        self.loop.run(_set())


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("gwworld")
    ca = trustme.CA()
    certified = [n for n in NAMES if n not in UNCERTIFIED]
    cert = ca.issue_cert(*certified, "canary.test", "rebind.test", "mixed.test", "127.0.0.1", "127.0.0.2")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    snis: list = []
    ctx.sni_callback = lambda _sock, name, _ctx: snis.append(name)
    hits, canary = Hits(), Hits()
    sse_release: dict = {}
    loop = LoopThread()
    dns = DnsServer()

    async def start():
        runners = []
        servers: list = []
        out = {}
        # The real HTTPS upstream (127.0.0.1:P) and the rebinding canary (127.0.0.2:P) share a port.
        for _attempt in range(20):
            canary_runner = web.AppRunner(make_app(canary, sse_release), access_log=None)
            await canary_runner.setup()
            canary_site = web.TCPSite(canary_runner, "127.0.0.2", 0, ssl_context=ctx)
            await canary_site.start()
            port = canary_site._server.sockets[0].getsockname()[1]
            https_runner = web.AppRunner(make_app(hits, sse_release), access_log=None)
            await https_runner.setup()
            try:
                await web.TCPSite(https_runner, "127.0.0.1", port, ssl_context=ctx).start()
            except OSError:
                await canary_runner.cleanup()
                await https_runner.cleanup()
                continue
            runners += [canary_runner, https_runner]
            out["https"] = port
            break
        rogue_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        trustme.CA().issue_cert("untrusted.test").configure_cert(rogue_ctx)  # a CA the gateway does not trust
        for key, app, host, tls in (
            ("untrusted", make_app(hits, sse_release), "127.0.0.1", rogue_ctx),
            ("http", make_app(hits, sse_release), "127.0.0.1", None),
            ("canary", make_app(canary, sse_release), "127.0.0.2", ctx),
        ):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, host, 0, ssl_context=tls)
            await site.start()
            out[key] = site._server.sockets[0].getsockname()[1]
            runners.append(runner)

        async def tcp_echo(reader, writer):
            data = b""
            try:
                while chunk := await reader.read(65536):
                    data += chunk
                    writer.write(b"echo:" + chunk)
                    await writer.drain()
            finally:
                hits.tcp.append(data)
                writer.close()

        async def evil_upgrade(reader, writer):
            """A hostile upstream: answers every request with 101 to a non-websocket protocol, then
            records whatever the client sends next (it must never get any)."""
            data = b""
            try:
                while b"\r\n\r\n" not in data and (chunk := await reader.read(65536)):
                    data += chunk
                writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: raw\r\nConnection: Upgrade\r\n\r\n")
                await writer.drain()
                while chunk := await reader.read(65536):
                    hits.tcp.append(b"after-101:" + chunk)
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        evil_server = await asyncio.start_server(evil_upgrade, "127.0.0.1", 0)
        out["evil"] = evil_server.sockets[0].getsockname()[1]
        servers.append(evil_server)
        tcp_server = await asyncio.start_server(tcp_echo, "127.0.0.1", 0)
        h2ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(h2ctx)
        h2ctx.set_alpn_protocols(["h2"])
        h2_server = await asyncio.start_server(lambda r, w: serve_h2(r, w, hits), "127.0.0.1", 0, ssl=h2ctx)
        out["h2"] = h2_server.sockets[0].getsockname()[1]
        servers.append(h2_server)
        out["tcp"] = tcp_server.sockets[0].getsockname()[1]
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: dns, local_addr=("127.0.0.1", 0))
        out["dns"] = transport.get_extra_info("sockname")[1]
        return out, runners, [tcp_server, *servers], transport

    ports, runners, tcp_servers, transport = loop.run(start())
    # A blackhole: backlog 0 plus one never-accepted connection, so further SYNs are dropped and a
    # connect hangs (the connect-timeout test).
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    filler = socket.create_connection(blackhole.getsockname(), timeout=2)
    ports["blackhole"] = blackhole.getsockname()[1]
    for name in NAMES:
        dns.records[name] = "127.0.0.1"
    dns.records["canary.test"] = "127.0.0.2"
    dns.records["hang.test"] = "127.0.0.1"
    dns.records["mixed.test"] = ["127.0.0.1", "127.0.0.2"]  # one allowed, one forbidden answer
    dns.flip["rebind.test"] = ["127.0.0.1", "127.0.0.2"]
    w = World(tmp=tmp, ca=ca, https_port=ports["https"], h2_port=ports["h2"], http_port=ports["http"],
              untrusted_port=ports["untrusted"], evil_port=ports["evil"],
              blackhole_port=ports["blackhole"],
              tcp_port=ports["tcp"],
              canary_https_port=ports["canary"], hits=hits, canary=canary, dns=dns, dns_port=ports["dns"],
              loop=loop, sse_release=sse_release, snis=snis)
    try:
        yield w
    finally:
        async def stop():
            for runner in runners:
                await runner.cleanup()
            for server in tcp_servers:
                server.close()
            transport.close()
        loop.run(stop())
        loop.stop()
        filler.close()
        blackhole.close()


# --------------------------------------------------------------------------------------- policies
def policies(w: World) -> dict[str, dict]:
    """Every policy the tests use, keyed by sandbox.name."""
    https, http, tcp, canary = w.https_port, w.http_port, w.tcp_port, w.canary_https_port

    def base(name: str, network: dict, resources: dict | None = None) -> dict:
        sandbox = {"name": name}
        if resources:
            sandbox["resources"] = resources
        return {"sandbox": sandbox, "network": {"allow_private": ["127.0.0.1/32"], **network}}

    api_rules = [
        {"id": "api-get", "host": "api.test", "ports": [https], "methods": ["GET"], "paths": ["/echo", "/v1/**",
                                                                                            "/sse", "/big",
                                                                                            "/redirect", "/ws"]},
        {"id": "api-post", "host": "api.test", "ports": [https], "methods": ["POST"], "paths": ["/upload"]},
    ]
    return {
        "gw-basic": base("gw-basic", {
            "https": {"allow": [
                *api_rules,
                {"id": "other-any", "host": "other.test", "ports": [https]},
                {"id": "sse", "host": "sse.test", "ports": [https], "methods": ["GET"]},
                {"id": "h2-get", "host": "h2.test", "ports": [w.h2_port], "methods": ["GET"], "paths": ["/ok/**"]},
                {"id": "rebind", "host": "rebind.test", "ports": [https]},
                {"id": "mixed", "host": "mixed.test", "ports": [https]},
                {"id": "untrusted", "host": "untrusted.test", "ports": [w.untrusted_port]},
                {"id": "badname", "host": "badname.test", "ports": [https]},
                {"id": "hang", "host": "hang.test", "ports": [w.blackhole_port]},
                {"id": "canary-name", "host": "canary.test", "ports": [canary]},
                {"id": "literal", "host": "127.0.0.2", "ports": [canary]},
            ]},
            "http": {"allow": [{"id": "plain", "host": "api.test", "ports": [http], "methods": ["GET", "POST"]},
                               {"id": "evil", "host": "other.test", "ports": [w.evil_port]}]},
        }),
        "gw-budget": base("gw-budget", {"https": {"allow": api_rules}, "http": {"allow": [
            {"id": "plain", "host": "api.test", "ports": [http], "methods": ["GET", "POST"]}]}},
            {"outbound_bytes_max": 4000}),
        "gw-tcp": base("gw-tcp", {
            "https": {"allow": [{"id": "api-any", "host": "api.test", "ports": [https]},
                                {"id": "open-https", "host": "open.test", "ports": [tcp]}]},
            "tcp": {"allow": [{"id": "tcp-echo", "host": "tcp.test", "ports": [tcp]}]}}),
        "gw-tcp-budget": base("gw-tcp-budget", {
            "tcp": {"allow": [{"id": "tcp-echo", "host": "tcp.test", "ports": [tcp]}]}}, {"outbound_bytes_max": 1000}),
        # no allow_private at all: loopback is forbidden like any other non-global address
        "gw-noprivate": {"sandbox": {"name": "gw-noprivate"}, "network": {"https": {"allow": [
            {"id": "api-any", "host": "api.test", "ports": [https]},
            {"id": "literal", "host": "127.0.0.1", "ports": [https]}]}}},
        # positive control: the canary address is allowed here, proving the canary is reachable
        "canary-open": {"sandbox": {"name": "canary-open"}, "network": {
            "allow_private": ["127.0.0.0/8"],
            "https": {"allow": [{"id": "canary-name", "host": "canary.test", "ports": [canary]},
                                {"id": "rebind", "host": "rebind.test", "ports": [https, canary]},
                                {"id": "literal", "host": "127.0.0.2", "ports": [canary]}]}}},
    }


@dataclass
class Gateway:
    proc: subprocess.Popen
    config: Path
    policy_dir: Path
    var: Path
    proxy: tuple[str, int]
    admin: str
    token: str
    world: World

    @property
    def bundle(self) -> str:
        return str(self.var / "ca" / "sandbox-ca-bundle.pem")

    def admit(self, policy: str, labels: dict | None = None) -> Sandbox:
        res = httpx.post(f"http://{self.admin}/v1/sandboxes", json={"policy": policy, "labels": labels or {}},
                         headers={"Authorization": f"Bearer {self.token}"}, timeout=10, trust_env=False)
        assert res.status_code == 201, res.text
        data = res.json()
        return Sandbox(id=data["id"], token=data["token"], proxy_url=data["proxy_url"], env=data["env"], gw=self)

    def revoke(self, sandbox_id: str) -> httpx.Response:
        return httpx.delete(f"http://{self.admin}/v1/sandboxes/{sandbox_id}",
                            headers={"Authorization": f"Bearer {self.token}"}, timeout=10, trust_env=False)

    def audit_records(self) -> list[dict]:
        path = self.var / "audit.jsonl"
        out = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]
            attrs = {}
            for kv in rec["attributes"]:
                value = kv["value"]
                attrs[kv["key"]] = next(iter(value.values())) if value else None
            out.append(attrs)
        return out


@dataclass
class Sandbox:
    id: str
    token: str
    proxy_url: str
    env: dict
    gw: Gateway

    def client(self, **kw) -> httpx.Client:
        verify = ssl.create_default_context(cafile=self.gw.bundle)
        return httpx.Client(proxy=self.proxy_url, verify=verify, timeout=15, trust_env=False, **kw)

    def url(self, host: str, path: str, port: int | None = None, scheme: str = "https") -> str:
        port = port or (self.gw.world.https_port if scheme == "https" else self.gw.world.http_port)
        return f"{scheme}://{host}:{port}{path}"


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else ""


def start_gateway(w: World, tmp: Path, extra_config: dict | None = None, launcher: list[str] | None = None) -> Gateway:
    """`launcher` replaces the `egressgate` command (e.g. a script that plants a fault, then runs the CLI)."""
    policy_dir = tmp / "policies"
    policy_dir.mkdir(parents=True, exist_ok=True)
    for name, doc in policies(w).items():
        (policy_dir / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    var = tmp / "var"
    ca_bundle = tmp / "upstream-ca.pem"
    ca_bundle.write_bytes(w.ca.cert_pem.bytes())
    config = {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": "127.0.0.2:0"},
        "policy": str(policy_dir),
        "var_dir": str(var),
        "upstream": {"resolver": f"127.0.0.1:{w.dns_port}", "ca_bundle": str(ca_bundle)},
        **(extra_config or {}),
    }
    cfg = tmp / "gateway.yaml"
    cfg.write_text(yaml.safe_dump(config))
    stderr = open(tmp / "gateway.stderr", "w")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen([*(launcher or [EGRESSGATE]), "run", "--config", str(cfg), "--log-level", "DEBUG"],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, "NO_PROXY": ""})
    line = _read_line(proc, 30)
    try:
        info = json.loads(line)
    except ValueError as exc:
        proc.kill()
        raise RuntimeError(f"gateway did not start: {line!r}\n{(tmp / 'gateway.stderr').read_text()[-3000:]}") from exc
    host, _, port = info["proxy"].rpartition(":")
    token = (var / "admin.token").read_text().strip()
    return Gateway(proc=proc, config=cfg, policy_dir=policy_dir, var=var, proxy=(host, int(port)),
                   admin=info["admin"], token=token, world=w)


def stop_gateway(gw: Gateway) -> int:
    if gw.proc.poll() is None:
        gw.proc.send_signal(signal.SIGTERM)
        try:
            return gw.proc.wait(15)
        except subprocess.TimeoutExpired:
            gw.proc.kill()
            gw.proc.wait(5)
            return -9
    return gw.proc.returncode


@pytest.fixture(scope="session")
def gateway(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway(world, tmp_path_factory.mktemp("gw"))
    try:
        yield gw
    finally:
        stop_gateway(gw)


# --------------------------------------------------------------------------------------- raw clients
def connect_tunnel(gw: Gateway, sbx: Sandbox | None, target: str, extra: str = "") -> tuple[socket.socket, bytes]:
    """Open a CONNECT tunnel with a raw socket; returns the socket and the proxy's response head."""
    sock = socket.create_connection(gw.proxy, timeout=10)
    auth = ""
    if sbx is not None:
        import base64

        auth = "Proxy-Authorization: Basic " + base64.b64encode(f"{sbx.id}:{sbx.token}".encode()).decode() + "\r\n"
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}{extra}\r\n".encode())
    status, headers, body = read_response(sock)
    head = f"HTTP/1.1 {status} -\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
    return sock, head + b"\r\n" + body


def read_head(sock) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def read_response(sock, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Read one HTTP/1.1 response (Content-Length or close-delimited)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        need = int(headers["content-length"])
        while len(body) < need:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return status, headers, body


def tls_wrap(sock: socket.socket, gw: Gateway, sni: str | None) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=gw.bundle)
    if sni is None:
        ctx.check_hostname = False
    return ctx.wrap_socket(sock, server_hostname=sni)


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
