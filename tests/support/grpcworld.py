"""A real gRPC world on loopback: a grpcio server over TLS (trustme CA), a DNS server naming it, and a
real gateway (`egressgate run`) whose policy allows some of its methods and not others.

Why grpcio on both ends, not a hand-made h2 peer: gRPC is the client that broke (the gateway dropped
`te: trailers`, which grpcio servers require, so every call ended in `UNAVAILABLE ... 502`), and what it
needs from a proxy (HTTP/2 end to end, `te: trailers` upstream, response trailers carrying grpc-status
and grpc-message back) is only proven by the real implementation. No .proto: the service is a generic
handler over raw bytes (no protoc, no grpcio-tools), which is all a proxy ever sees anyway.

Methods of `egress.test.Echo` (every call is counted in `GrpcUpstream.hits` by method):
- `Unary`: answers `b"echo:" + request`, with a custom trailing metadata entry;
- `Stream`: the request is an ASCII count N; answers N messages `b"%06d" % i`, in order;
- `Fail`: aborts with INVALID_ARGUMENT and FAIL_MESSAGE (non-ASCII: grpc-message is percent-encoded);
- `Secret`: answers normally: the policy does not allow it, so only a direct call may reach it.

Next to it, `h2rec.test`: a raw HTTP/2 upstream that does NOT validate what it receives and records every
request's header fields as they arrived (repeats and case kept), so a test can see exactly what te the
gateway forwarded — a validating peer would turn a forwarded `te: gzip` into a dropped connection, which
looks the same as a refusal.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import trustme

from tests.support.h2server import serve_h2_events
from tests.support.launcher import LoopbackGateway, launch_loopback, stop_gateway, write_policies
from tests.support.loopback import DnsServer, LoopThread, server_context, start_dns
from tests.support.replay_check import assert_config_replays

SERVICE = "egress.test.Echo"
HOST = "grpc.test"
H2REC = "h2rec.test"
FAIL_MESSAGE = "bad input: caf\u00e9 100% wrong\nsecond line"
ALLOWED = ("Unary", "Stream", "Fail")


@dataclass
class GrpcUpstream:
    server: grpc.Server
    port: int
    hits: collections.Counter = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hit(self, method: str) -> None:
        with self.lock:
            self.hits[method] += 1

    def count(self, method: str) -> int:
        with self.lock:
            return self.hits[method]


def _handlers(up: GrpcUpstream) -> grpc.GenericRpcHandler:
    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        up.hit("Unary")
        context.set_trailing_metadata((("x-echo-trailer", "kept"),))
        return b"echo:" + request

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        up.hit("Stream")
        for i in range(int(request)):
            yield b"%06d" % i

    def fail(request: bytes, context: grpc.ServicerContext) -> bytes:
        up.hit("Fail")
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, FAIL_MESSAGE)
        raise AssertionError("abort returns only by raising")

    def secret(request: bytes, context: grpc.ServicerContext) -> bytes:
        up.hit("Secret")
        return b"secret:" + request

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Fail": grpc.unary_unary_rpc_method_handler(fail),
        "Secret": grpc.unary_unary_rpc_method_handler(secret),
    })


@contextlib.contextmanager
def grpc_upstream(ca: trustme.CA) -> Iterator[GrpcUpstream]:
    """A TLS gRPC server on 127.0.0.1 (free port) presenting a `grpc.test` certificate from `ca`."""
    cert = ca.issue_cert(HOST, "127.0.0.1")
    creds = grpc.ssl_server_credentials([(cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes())])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    port = server.add_secure_port("127.0.0.1:0", creds)
    up = GrpcUpstream(server=server, port=port)
    server.add_generic_rpc_handlers((_handlers(up),))
    server.start()
    try:
        yield up
    finally:
        server.stop(grace=None)


def channel(target: str, root_pem: bytes, proxy: str | None = None, authority: str | None = None) -> grpc.Channel:
    """A secure channel trusting only `root_pem`; `proxy` (`http://id:token@host:port`) goes through the
    gateway as an explicit CONNECT proxy (grpcio turns the URL's userinfo into Proxy-Authorization:
    Basic). Environment proxies are disabled (`grpc.enable_http_proxy=0`) unless `proxy` is given, so a
    direct call is direct whatever the host's environment says."""
    options: list[tuple[str, object]] = [("grpc.enable_retries", 0)]
    if proxy is not None:
        options.append(("grpc.http_proxy", proxy))
    else:
        options.append(("grpc.enable_http_proxy", 0))
    if authority is not None:
        options.append(("grpc.ssl_target_name_override", authority))
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root_pem), options=options)


def method(ch: grpc.Channel, name: str, streaming: bool = False):
    """A raw-bytes callable for `/egress.test.Echo/<name>` (no serializers: bytes in, bytes out)."""
    path = f"/{SERVICE}/{name}"
    return ch.unary_stream(path) if streaming else ch.unary_unary(path)


@dataclass
class H2Recorder:
    """What the raw HTTP/2 upstream received: one list of (name, value) byte pairs per request."""

    port: int = 0
    requests: list[list[tuple[bytes, bytes]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def mark(self) -> int:
        return len(self.requests)

    def since(self, mark: int) -> list[list[tuple[bytes, bytes]]]:
        with self.lock:
            return list(self.requests[mark:])

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def on_event(conn: h2.connection.H2Connection, event: h2.events.Event) -> bool:
            if isinstance(event, h2.events.RequestReceived):
                with self.lock:
                    self.requests.append(list(event.headers))
                conn.send_headers(event.stream_id, [(":status", "200"), ("content-length", "2")])
                conn.send_data(event.stream_id, b"ok", end_stream=True)
            return False

        config = h2.config.H2Configuration(client_side=False, validate_inbound_headers=False,
                                           normalize_inbound_headers=False, header_encoding=None)
        await serve_h2_events(reader, writer, on_event, config)


@dataclass
class GrpcWorld:
    ca: trustme.CA
    upstream: GrpcUpstream
    gateway: LoopbackGateway
    dns_port: int
    recorder: H2Recorder

    @property
    def target(self) -> str:
        return f"{HOST}:{self.upstream.port}"

    def proxy_url(self) -> str:
        """A fresh sandbox's proxy URL (`http://id:token@127.0.0.1:port`): each caller its own identity."""
        return self.gateway.admit_sandbox({"policy": "grpc", "labels": {}})["proxy_url"]

    def gateway_roots(self) -> bytes:
        return Path(self.gateway.bundle).read_bytes()


def grpc_policy(port: int, h2rec_port: int) -> dict:
    return {"sandbox": {"name": "grpc"}, "network": {
        "allow_private": ["127.0.0.1/32"],
        "https": {"allow": [{"id": "grpc-echo", "host": HOST, "ports": [port], "methods": ["POST"],
                             "paths": [f"/{SERVICE}/{m}" for m in ALLOWED]},
                            {"id": "h2rec", "host": H2REC, "ports": [h2rec_port]}]}}}


@contextlib.contextmanager
def open_grpc_world(tmp: Path) -> Iterator[GrpcWorld]:
    """The gRPC upstream, a DNS server answering `grpc.test` -> 127.0.0.1 and a gateway trusting the
    upstream's CA; everything on free loopback ports, everything stopped after."""
    ca = trustme.CA()
    loop = LoopThread()
    dns = DnsServer()
    dns.records[HOST] = "127.0.0.1"
    dns.records[H2REC] = "127.0.0.1"
    recorder = H2Recorder()

    async def start() -> tuple[asyncio.DatagramTransport, int, asyncio.Server]:
        transport, dns_port = await start_dns(dns)
        h2ctx = server_context(ca.issue_cert(H2REC), ["h2"])
        server = await asyncio.start_server(recorder.serve, "127.0.0.1", 0, ssl=h2ctx)
        recorder.port = server.sockets[0].getsockname()[1]
        return transport, dns_port, server

    transport, dns_port, h2server = loop.run(start())
    try:
        with grpc_upstream(ca) as up:
            policy_dir = write_policies(tmp / "policies", {"grpc": grpc_policy(up.port, recorder.port)})
            ca_bundle = tmp / "upstream-ca.pem"
            ca_bundle.write_bytes(ca.cert_pem.bytes())
            config = {
                "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
                "policy": str(policy_dir),
                "var_dir": str(tmp / "var"),
                "upstream": {"resolver": f"127.0.0.1:{dns_port}", "ca_bundle": str(ca_bundle)},
            }
            gw = LoopbackGateway(**launch_loopback(tmp, config))
            try:
                yield GrpcWorld(ca=ca, upstream=up, gateway=gw, dns_port=dns_port, recorder=recorder)
            finally:
                stop_gateway(gw)
            # every decision the module's tests made replays the same under its policy (issue 23, item 1)
            assert_config_replays(gw.config)
    finally:
        loop.close(servers=[h2server], transports=[transport])
