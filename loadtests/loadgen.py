"""A bounded, multi-process, keep-alive HTTP/1.1 load generator that speaks proxy protocols.

wrk cannot use a proxy, so this speaks the wire itself: origin-form to the upstream (direct),
absolute-form to an explicit proxy (plain HTTP), or CONNECT then TLS inside the tunnel (HTTPS; the proxy
may intercept it, the client trusts whichever CA the target names). Every connection is opened and warmed
with one request before the clock starts (TLS handshakes and certificate minting are not measured),
then all processes start together and stop at a shared deadline: a cell always ends by itself.

Only the proxy and upstream addresses the caller passes are contacted (the harness passes loopback
addresses, or 198.18.0.0/15 addresses inside namespaces it created, and `Target` refuses anything else).
A request counts as OK only with status 200 and a complete body of the expected length: a fast deny must
never look like throughput.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import multiprocessing as mp
import os
import ssl
import statistics
import time
from dataclasses import dataclass, field

READ_LIMIT = 1 << 20
# RFC 2544 benchmarking range: the addresses of the namespaces `make bench` creates (loadtests/bench_world.py)
BENCH_NET = ipaddress.ip_network("198.18.0.0/15")


@dataclass(frozen=True)
class Target:
    """What a connection talks to. `host`/`port` name the upstream as the request names it."""

    scheme: str  # "http" | "https"
    host: str  # name in the URL / SNI, e.g. "localhost"
    port: int  # upstream port
    dial: tuple[str, int]  # where the TCP connection goes: the upstream (direct) or the proxy
    via_proxy: bool
    ca_file: str | None = None  # the CA the client trusts for TLS (upstream CA, or the MITM CA)
    proxy_auth: tuple[str, str] | None = None  # (id, token) -> Proxy-Authorization: Basic
    path: str = "/"
    expect_body: int | None = None  # expected body length for the OK check (None: any)
    # Python >= 3.13 verifies X.509 strictly (VERIFY_X509_STRICT); Squid 5's ssl-bump certificates carry no
    # Authority Key Identifier, which only that flag rejects. False drops that one flag (chain and name are
    # still verified against ca_file), as OpenSSL's own clients (curl) verify; loadtests/bench.py sets it for
    # the squid-bump cells only.
    x509_strict: bool = True

    def __post_init__(self) -> None:
        addr = ipaddress.ip_address(self.dial[0])
        if not (addr.is_loopback or addr in BENCH_NET):
            raise ValueError(f"benchmarks dial loopback or {BENCH_NET} (namespaces they create) only, "
                             f"not {self.dial[0]}")

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"

    def auth_header(self) -> bytes:
        if self.proxy_auth is None:
            return b""
        raw = base64.b64encode(f"{self.proxy_auth[0]}:{self.proxy_auth[1]}".encode())
        return b"Proxy-Authorization: Basic " + raw + b"\r\n"

    def request_bytes(self, path: str | None = None) -> bytes:
        path = path or self.path
        if self.via_proxy and self.scheme == "http":
            line = f"GET http://{self.authority}{path} HTTP/1.1\r\n".encode()
            return line + f"Host: {self.authority}\r\n".encode() + self.auth_header() + b"\r\n"
        return f"GET {path} HTTP/1.1\r\nHost: {self.authority}\r\n\r\n".encode()

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if not self.x509_strict:
            ctx.verify_flags &= ~ssl.VERIFY_X509_STRICT
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


class BadResponse(Exception):
    pass


async def connect(target: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection ready for origin-/absolute-form requests (CONNECT + TLS done when needed)."""
    host, port = target.dial
    if not target.via_proxy:
        if target.scheme == "https":
            return await asyncio.open_connection(host, port, ssl=target.ssl_context(),
                                                 server_hostname=target.host, limit=READ_LIMIT)
        return await asyncio.open_connection(host, port, limit=READ_LIMIT)
    reader, writer = await asyncio.open_connection(host, port, limit=READ_LIMIT)
    if target.scheme == "https":
        writer.write(f"CONNECT {target.authority} HTTP/1.1\r\nHost: {target.authority}\r\n".encode()
                     + target.auth_header() + b"\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
            writer.close()
            raise BadResponse("CONNECT refused: " + head.split(b"\r\n", 1)[0].decode(errors="replace"))
        await writer.start_tls(target.ssl_context(), server_hostname=target.host)
    return reader, writer


async def read_response(reader: asyncio.StreamReader) -> tuple[int, int]:
    """Read one response; returns (status, body length). Handles Content-Length and chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    i = lower.find(b"\r\ncontent-length:")
    if i >= 0:
        j = lower.find(b"\r\n", i + 2)
        n = int(lower[i + 17:j])
        if n:
            await reader.readexactly(n)
        return status, n
    if b"\r\ntransfer-encoding: chunked" in lower:
        total = 0
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            total += size
            if size == 0:
                return status, total
    raise BadResponse(f"unframed response (status {status})")


@dataclass
class WorkerResult:
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def _conn_loop(target: Target, result: WorkerResult, ready: asyncio.Future, window: asyncio.Future,
                     conns: list) -> None:
    request = target.request_bytes()
    try:
        reader, writer = await connect(target)
        conns.append(writer)
        writer.write(request)
        status, n = await read_response(reader)
        if status != 200:
            raise BadResponse(f"warm-up status {status}")
    except (OSError, BadResponse, asyncio.IncompleteReadError, ValueError, ssl.SSLError) as exc:
        result.error(f"connect: {type(exc).__name__}: {str(exc)[:80]}")
        return
    finally:
        ready.set_result(None)
    t_start, t_end = await window
    clock = time.monotonic
    expect = target.expect_body
    lat = result.latencies_ms
    while True:
        t0 = clock()
        if t0 >= t_end:
            return
        try:
            writer.write(request)
            status, n = await read_response(reader)
        except (OSError, BadResponse, asyncio.IncompleteReadError, ValueError, ssl.SSLError) as exc:
            result.error(f"{type(exc).__name__}: {str(exc)[:80]}")
            return  # this connection is done; a broken keep-alive connection is an error, not a retry
        t1 = clock()
        if t0 < t_start or t1 > t_end:
            continue
        if status != 200 or (expect is not None and n != expect):
            result.error(f"status {status} len {n}")
            continue
        result.ok += 1
        lat.append((t1 - t0) * 1000.0)


async def _worker_main(target: Target, n_conns: int, pipe) -> WorkerResult:
    loop = asyncio.get_running_loop()
    result = WorkerResult()
    readies = [loop.create_future() for _ in range(n_conns)]
    window: asyncio.Future = loop.create_future()
    conns: list = []
    tasks = [asyncio.create_task(_conn_loop(target, result, readies[i], window, conns)) for i in range(n_conns)]
    await asyncio.gather(*readies)  # every connection warmed up (or failed and recorded why)
    pipe.send("ready")
    t_start, t_end = await loop.run_in_executor(None, pipe.recv)
    cpu0 = time.process_time()
    window.set_result((t_start, t_end))
    try:
        async with asyncio.timeout_at(loop.time() + (t_end - time.monotonic()) + 5.0):
            await asyncio.gather(*tasks)
    except TimeoutError:
        result.error("request still pending 5 s after the window")
    result.cpu_s = time.process_time() - cpu0
    for writer in conns:
        writer.transport.abort()
    return result


def _worker(target: Target, n_conns: int, pipe) -> None:
    try:
        result = asyncio.run(_worker_main(target, n_conns, pipe))
    except Exception as exc:  # reported to the parent, never hangs it
        result = WorkerResult()
        result.error(f"worker crashed: {type(exc).__name__}: {exc}")
        with contextlib.suppress(OSError):
            pipe.send("ready")
    pipe.send(result)


@dataclass
class CellResult:
    rps: float
    p50_ms: float
    p99_ms: float
    ok: int
    errors: dict[str, int]
    seconds: float
    loadgen_cpu: float  # CPU seconds of all client processes / window (1.0 = one core)


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def run_cell(target: Target, concurrency: int, seconds: float, procs: int | None = None,
             setup_timeout: float = 60.0) -> CellResult:
    """Run one load cell: `concurrency` keep-alive connections over `procs` processes for `seconds`."""
    procs = procs or (1 if concurrency == 1 else min(concurrency, max(2, (os.cpu_count() or 2))))
    per = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    ctx = mp.get_context("fork")
    workers = []
    for n in per:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(target, n, child), daemon=True)
        proc.start()
        workers.append((proc, parent))
    try:
        for _proc, pipe in workers:
            if not pipe.poll(setup_timeout):
                raise RuntimeError("load worker did not get ready (connect/warm-up hung)")
            pipe.recv()
        t_start = time.monotonic() + 0.05
        t_end = t_start + seconds
        for _proc, pipe in workers:
            pipe.send((t_start, t_end))
        results: list[WorkerResult] = []
        for _proc, pipe in workers:
            if not pipe.poll(max(1.0, t_end - time.monotonic()) + 15.0):
                raise RuntimeError("load worker did not report after the window")
            results.append(pipe.recv())
    finally:
        for proc, _pipe in workers:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    lat = sorted(x for r in results for x in r.latencies_ms)
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r.errors.items():
            errors[k] = errors.get(k, 0) + v
    ok = sum(r.ok for r in results)
    return CellResult(
        rps=ok / seconds, p50_ms=statistics.median(lat) if lat else float("nan"), p99_ms=percentile(lat, 0.99),
        ok=ok, errors=errors, seconds=seconds, loadgen_cpu=sum(r.cpu_s for r in results) / seconds,
    )
