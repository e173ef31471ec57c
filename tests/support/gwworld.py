"""Loopback world for the gateway tests: real upstreams (TLS via trustme), a test DNS server, and the
real gateway started as `egressgate run --config ...` on port 0.

The world and the gateway start once per session (~2 s, fixtures in tests/gateway/conftest.py) and tests
stay independent by admitting a fresh sandbox per test: budgets, identity and revocation are per sandbox.
Destinations: names under `.test` resolve (through our DNS server only) to 127.0.0.1, where the
upstreams listen; the *canary* listens on 127.0.0.2, which every policy except `canary-open` forbids
(`allow_private: [127.0.0.1/32]`), so a gateway bug shows up as a canary hit.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import trustme

from tests.support.http1 import read_reply
from tests.support.launcher import LoopbackGateway, launch_loopback, write_policies
from tests.support.loopback import DnsServer, Hits, LoopThread, serve_app, server_context, start_dns
from tests.support.upstreams import make_app, serve_h2

NAMES = ["untrusted.test", "badname.test", "h2.test", "api.test", "other.test", "sse.test", "tcp.test",
         "open.test", "nohost.test"]
UNCERTIFIED = ("untrusted.test", "badname.test")  # the test CA's certificate does not name these


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


@contextlib.contextmanager
def open_world(tmp: Path) -> Iterator[World]:
    """Start every upstream, the canary, the DNS server and the blackhole on loopback; stop them after."""
    ca = trustme.CA()
    certified = [n for n in NAMES if n not in UNCERTIFIED]
    cert = ca.issue_cert(*certified, "canary.test", "rebind.test", "mixed.test", "127.0.0.1", "127.0.0.2")
    ctx = server_context(cert)
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
            canary_runner, port = await serve_app(make_app(canary, sse_release), "127.0.0.2", ctx)
            try:
                https_runner, _ = await serve_app(make_app(hits, sse_release), "127.0.0.1", ctx, port)
            except OSError:  # the port is taken on 127.0.0.1: try another
                await canary_runner.cleanup()
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
            runner, out[key] = await serve_app(app, host, tls)
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
        h2ctx = server_context(cert, ["h2"])
        h2_server = await asyncio.start_server(lambda r, w: serve_h2(r, w, hits), "127.0.0.1", 0, ssl=h2ctx)
        out["h2"] = h2_server.sockets[0].getsockname()[1]
        servers.append(h2_server)
        out["tcp"] = tcp_server.sockets[0].getsockname()[1]
        transport, out["dns"] = await start_dns(dns)
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
        loop.close(runners, tcp_servers, [transport])
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
class Gateway(LoopbackGateway):
    policy_dir: Path
    world: World

    def admit(self, policy: str, labels: dict | None = None) -> Sandbox:
        data = self.admit_sandbox({"policy": policy, "labels": labels or {}})
        return Sandbox(id=data["id"], token=data["token"], proxy_url=data["proxy_url"], env=data["env"], gw=self)


@dataclass
class Sandbox:
    id: str
    token: str
    proxy_url: str
    env: dict
    gw: Gateway

    def client(self, **kw) -> httpx.Client:
        return self.gw.proxied_client(self.proxy_url, **kw)

    def url(self, host: str, path: str, port: int | None = None, scheme: str = "https") -> str:
        port = port or (self.gw.world.https_port if scheme == "https" else self.gw.world.http_port)
        return f"{scheme}://{host}:{port}{path}"


def start_gateway(w: World, tmp: Path, extra_config: dict | None = None, launcher: list[str] | None = None,
                  args: Sequence[str] = ()) -> Gateway:
    """Every policy of `policies(w)`, the world's DNS server and CA; `extra_config` is merged at the top
    level. `launcher` replaces the `egressgate` command (e.g. a script that plants a fault, then runs the CLI);
    `args` are added to `run`'s (`--workers 2`)."""
    policy_dir = write_policies(tmp / "policies", policies(w))
    ca_bundle = tmp / "upstream-ca.pem"
    ca_bundle.write_bytes(w.ca.cert_pem.bytes())
    config = {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": "127.0.0.2:0"},
        "policy": str(policy_dir),
        "var_dir": str(tmp / "var"),
        "upstream": {"resolver": f"127.0.0.1:{w.dns_port}", "ca_bundle": str(ca_bundle)},
        **(extra_config or {}),
    }
    return Gateway(**launch_loopback(tmp, config, launcher=launcher, args=args), policy_dir=policy_dir, world=w)


# --------------------------------------------------------------------------------------- raw clients
def connect_tunnel(gw: LoopbackGateway, sbx: Sandbox | None, target: str,
                   extra: str = "", read_refusal: bool = True) -> tuple[socket.socket, bytes]:
    """Open a CONNECT tunnel with a raw socket; returns the socket and the proxy's response head.

    A CONNECT the policy refuses is accepted by default and its deny answered inside the tunnel (a 200
    carrying `X-Egressgate-Decision: deny`, gateway/pipeline/refused_tunnel.py). With `read_refusal` such a refusal
    is read as a client reads it, one plain request inside, and that answer (the deny body under the
    CONNECT's request id) is returned instead of the 200."""
    sock = socket.create_connection(gw.proxy, timeout=10)
    credentials = auth(sbx) if sbx is not None else ""
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{credentials}{extra}\r\n".encode())
    status, headers, body = read_reply(sock)
    if read_refusal and status == 200 and headers.get("x-egressgate-decision") == "deny":
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n".encode())
        connect_id = headers.get("x-egressgate-request-id")
        status, headers, body = read_reply(sock)
        assert headers.get("x-egressgate-request-id") == connect_id, (status, headers, body)
    head = f"HTTP/1.1 {status} -\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
    return sock, head + b"\r\n" + body


def raw_bytes_in_tunnel(gw: LoopbackGateway, sbx: Sandbox, target: str,
                        data: bytes = b"\x00\x01 raw bytes that are not http\n") -> tuple[int, dict, bytes]:
    """Open a CONNECT tunnel to `target` (it must be granted), send `data` that is neither TLS nor HTTP,
    and return the gateway's reply (status, headers, body) — the raw-TCP decision's deny, or status 0."""
    sock, head = connect_tunnel(gw, sbx, target)
    try:
        assert head.startswith(b"HTTP/1.1 200"), head
        sock.sendall(data)
        return read_reply(sock, timeout=5)
    finally:
        sock.close()


def auth(sbx: Sandbox) -> str:
    """The Proxy-Authorization header line (CRLF included) naming `sbx`."""
    return "Proxy-Authorization: Basic " + base64.b64encode(f"{sbx.id}:{sbx.token}".encode()).decode() + "\r\n"


def dial(gw: LoopbackGateway, source: str = "127.0.0.1") -> socket.socket:
    """A plain TCP connection to the proxy listener from `source` (a 127/8 address: a distinct client)."""
    return socket.create_connection(gw.proxy, timeout=10, source_address=(source, 0))


def connection_records(gw: LoopbackGateway, reason: str) -> list[dict]:
    """The connection-level audit records (limits, handshakes) with `reason`."""
    return [r for r in gw.audit_records()
            if r.get("egressgate.operation") == "connection" and r.get("egressgate.reason") == reason]


def tls_wrap(sock: socket.socket, gw: LoopbackGateway, sni: str | None) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=gw.bundle)
    if sni is None:
        ctx.check_hostname = False
    return ctx.wrap_socket(sock, server_hostname=sni)
