"""The benchmark upstream: a minimal asyncio HTTP/1.1 server on loopback, plain and TLS.

Why not aiohttp: the upstream must never be the bottleneck of a proxy benchmark. A bare
`asyncio.Protocol` that answers from a pre-built byte string does ~10-20k rps per core on these machines
(measured with wrk in RESULTS.md), an order of magnitude above what any proxy under test reaches, while
aiohttp's routing and header objects cost several times more per request.

Routes (any method; request bodies framed by Content-Length are read and discarded):
  /bytes/N   N bytes (Content-Length); up to 256 KiB in one write, more in 256 KiB chunks with transport
             flow control, so a 1 GiB download never sits in this process's memory
  /sse       text/event-stream, chunked: one event at once, the next after --sse-gap seconds, then end
  /__stats   JSON counters: connections accepted, requests, and requests that carried
             `Authorization: Bearer bench-secret-...`
             (the credential the benchmark's egressgate injects: proof that injection really happened)
  anything   200 with a fixed small body (SMALL_BODY)

Run: `python -m loadtests.upstream --cert C --key K` prints one JSON line {"http": "127.0.0.1:P",
"https": "127.0.0.1:Q", "pid": N} and serves until SIGTERM/SIGINT. Loopback (or, with --host, an address of
a namespace the bench created, in 198.18.0.0/15) only; ports picked by the OS.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import ssl
import sys

SMALL_BODY = b"egressgate benchmark upstream: a fixed small response body.\n"  # 59 bytes
SMALL_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
    + str(len(SMALL_BODY)).encode() + b"\r\n\r\n" + SMALL_BODY
)
CHUNK = 256 * 1024
FILLER = (b"0123456789abcdef" * (CHUNK // 16))
MAX_HEAD = 64 * 1024
BYTES_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: "


class Upstream(asyncio.Protocol):
    """One connection: parse request heads from a buffer, answer; slow routes run as a task and pause
    parsing of later (pipelined) requests until they finish."""

    sse_gap = 2.0
    requests = 0
    bearer_seen = 0
    connections = 0

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy: asyncio.Task | None = None
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        Upstream.connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.can_write.set()
        if self.busy is not None:
            self.busy.cancel()

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.busy is None:
            self._process()

    def _process(self) -> None:
        transport = self.transport
        assert transport is not None
        while self.busy is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    transport.close()
                return
            head = bytes(self.buf[:end])
            body_len = 0
            lower = head.lower()
            i = lower.find(b"\r\ncontent-length:")
            if i >= 0:
                j = lower.find(b"\r\n", i + 2)
                body_len = int(lower[i + 17: j if j >= 0 else None].strip() or b"0")
            total = end + 4 + body_len
            if len(self.buf) < total:
                return
            del self.buf[:total]
            Upstream.requests += 1
            if b"\r\nauthorization: bearer bench-secret-" in lower:
                Upstream.bearer_seen += 1
            line_end = head.find(b"\r\n")
            parts = head[: line_end if line_end >= 0 else None].split(b" ")
            path = parts[1] if len(parts) == 3 else b"/"
            if path.startswith(b"/bytes/"):
                n = int(path[7:].split(b"?")[0])
                if n <= CHUNK:  # small: one write, no task (the bench's 1 KiB GETs must not slow the upstream)
                    transport.write(BYTES_HEAD + str(n).encode() + b"\r\n\r\n" + FILLER[:n])
                    continue
                self.busy = asyncio.ensure_future(self._bytes(n))
            elif path == b"/__stats":
                body = json.dumps({"requests": Upstream.requests, "bearer_seen": Upstream.bearer_seen,
                                   "connections": Upstream.connections}).encode()
                transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
                continue
            elif path.startswith(b"/sse"):
                self.busy = asyncio.ensure_future(self._sse())
            else:
                transport.write(SMALL_RESPONSE)
                continue
            self.busy.add_done_callback(self._done)

    def _done(self, _task: asyncio.Task) -> None:
        self.busy = None
        if self.transport is not None and not self.transport.is_closing():
            self._process()

    async def _bytes(self, n: int) -> None:
        transport = self.transport
        assert transport is not None
        transport.write(BYTES_HEAD + str(n).encode() + b"\r\n\r\n")
        view = memoryview(FILLER)
        while n > 0 and not transport.is_closing():
            await self.can_write.wait()
            k = min(n, CHUNK)
            transport.write(view[:k])
            n -= k

    async def _sse(self) -> None:
        transport = self.transport
        assert transport is not None
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n")
        for n in (1, 2):
            if n > 1:
                await asyncio.sleep(self.sse_gap)
            event = f"id: {n}\nevent: tick\ndata: {{\"n\": {n}}}\n\n".encode()
            transport.write(b"%x\r\n%s\r\n" % (len(event), event))
        transport.write(b"0\r\n\r\n")


async def serve(cert: str | None, key: str | None, host: str, sse_gap: float) -> None:
    Upstream.sse_gap = sse_gap
    loop = asyncio.get_running_loop()
    plain = await loop.create_server(Upstream, host, 0, backlog=1024)
    servers = [plain]
    info = {"http": "{}:{}".format(*plain.sockets[0].getsockname()[:2]), "pid": os.getpid()}
    if cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        tls = await loop.create_server(Upstream, host, 0, ssl=ctx, backlog=1024)
        servers.append(tls)
        info["https"] = "{}:{}".format(*tls.sockets[0].getsockname()[:2])
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def _bench_address(value: str) -> str:
    """Network safety: serve only on loopback or in the bench's own namespaces (loadtests/bench_world.py)."""
    addr = ipaddress.ip_address(value)
    if not (addr.is_loopback or addr in ipaddress.ip_network("198.18.0.0/15")):
        raise argparse.ArgumentTypeError(f"{value}: not loopback nor 198.18.0.0/15")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cert", help="PEM certificate chain for the TLS listener (omit: plain only)")
    ap.add_argument("--key", help="PEM private key")
    ap.add_argument("--host", default="127.0.0.1", type=_bench_address,
                    help="loopback, or a 198.18.0.0/15 address of a namespace the bench created")
    ap.add_argument("--sse-gap", type=float, default=2.0)
    args = ap.parse_args()
    asyncio.run(serve(args.cert, args.key, args.host, args.sse_gap))


if __name__ == "__main__":
    main()
