"""The loopback world's building blocks: an asyncio loop for the servers, hit logs, a test DNS server.

The tests themselves are synchronous; every upstream and the DNS server run on one `LoopThread`. Hit logs
are only appended to (never truncated), so a test reads what happened since its `mark()` and stays
independent of the others sharing a session-scoped world.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import trustme
from aiohttp import web
from dnslib import QTYPE, RR, A, DNSRecord


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

    def close(self, runners=(), servers=(), transports=()) -> None:
        """A world's teardown: clean up its aiohttp runners, close its asyncio servers and datagram
        transports on this loop (they belong to it), then stop the loop."""
        async def stop():
            for runner in runners:
                await runner.cleanup()
            for server in servers:
                server.close()
            for transport in transports:
                transport.close()
        self.run(stop())
        self.stop()


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


def server_context(cert: trustme.LeafCert, alpn: list[str] | None = None) -> ssl.SSLContext:
    """A TLS server context presenting `cert` (optionally offering only `alpn`)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


async def start_dns(dns: DnsServer, host: str = "127.0.0.1") -> tuple[asyncio.DatagramTransport, int]:
    """Serve `dns` on a free UDP port of `host` (call on the world's loop); returns the transport and port."""
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(lambda: dns, local_addr=(host, 0))
    return transport, transport.get_extra_info("sockname")[1]


async def serve_app(app: web.Application, host: str, tls: ssl.SSLContext | None,
                    port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: a free one) on the running loop; the runner (cleanup it) and the port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner, site._server.sockets[0].getsockname()[1]


@dataclass(frozen=True)
class RequestHead:
    """One HTTP/1.1 request head as a raw loopback upstream received it."""

    method: str
    path: str
    headers: dict[str, str]  # names lower-cased, values stripped
    size: int  # bytes of the head, the blank line included


async def read_request_head(reader: asyncio.StreamReader) -> RequestHead | None:
    """The next request head on a raw upstream connection (the upstreams that must see the exact bytes
    the gateway sent: tests/support/budgetworld.py, tests/gateway_credentials/rawcodings.py); None when
    the client closed before a whole head arrived."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path = lines[0].split(" ")[:2]
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
    return RequestHead(method, path, headers, len(head))


async def serve_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     answer: Callable[[str, bytes], tuple[bytes, bytes]]) -> None:
    """A raw HTTP/1.1 upstream's keep-alive connection (the JSON-RPC upstreams of
    tests/mcp/test_engine_route_spellings.py and loadtests/mcp_bench_gateway.py): every request's target
    and Content-Length body go to `answer`, which returns the status (b"200 OK") and a JSON body; until the
    client closes."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ", 2)[1].decode("latin-1")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            status, out = answer(target, await reader.readexactly(length) if length else b"")
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(out)).encode() + b"\r\n\r\n" + out)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()
