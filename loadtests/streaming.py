"""Streaming checks through a proxy: a large download (throughput + the proxy's peak RSS) and time to
first SSE event (issue 3: a 1 GiB download keeps the gateway under 150 MB RSS; the first event of an
event stream arrives while the upstream is still waiting to send the next one).

Both use one keep-alive connection per measurement (loadgen.connect: direct, absolute-form or CONNECT+TLS),
warmed with one small request first, so handshakes and certificate minting are not in the figures.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import time
from dataclasses import dataclass

from loadtests.loadgen import BadResponse, Target, connect, read_response

READ = 1 << 20


@dataclass
class Download:
    bytes: int
    seconds: float
    ok: bool
    error: str | None = None

    @property
    def mib_per_s(self) -> float:
        return self.bytes / (1 << 20) / self.seconds if self.seconds else 0.0


async def _download(target: Target, n: int, timeout: float) -> Download:
    reader, writer = await connect(target)
    try:
        writer.write(target.request_bytes())
        await read_response(reader)
        t0 = time.monotonic()
        writer.write(target.request_bytes(f"/bytes/{n}"))
        async with asyncio.timeout(timeout):
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            if status != 200:
                return Download(0, time.monotonic() - t0, False, f"status {status}")
            lower = head.lower()
            got = 0
            if b"\r\ncontent-length:" in lower:
                while got < n:
                    chunk = await reader.read(min(READ, n - got))
                    if not chunk:
                        break
                    got += len(chunk)
            else:  # chunked: count payload bytes only
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    left = size
                    while left:
                        chunk = await reader.read(min(READ, left))
                        if not chunk:
                            raise BadResponse("connection closed mid-chunk")
                        left -= len(chunk)
                    await reader.readexactly(2)
                    got += size
                    if size == 0:
                        break
        seconds = time.monotonic() - t0
        return Download(got, seconds, got == n, None if got == n else f"short body: {got} of {n}")
    except (TimeoutError, OSError, BadResponse, asyncio.IncompleteReadError, ValueError) as exc:
        return Download(0, 0.0, False, f"{type(exc).__name__}: {exc}")
    finally:
        writer.transport.abort()


def download(target: Target, n: int, timeout: float = 300.0) -> Download:
    return asyncio.run(_download(target, n, timeout))


@dataclass
class SseTiming:
    first_event_ms: float | None
    second_event_ms: float | None
    error: str | None = None


async def _sse(target: Target, timeout: float) -> SseTiming:
    reader, writer = await connect(target)
    try:
        writer.write(target.request_bytes())
        await read_response(reader)
        t0 = time.monotonic()
        writer.write(target.request_bytes("/sse"))
        seen: list[float] = []
        buf = b""
        async with asyncio.timeout(timeout):
            head = await reader.readuntil(b"\r\n\r\n")
            if int(head[9:12]) != 200:
                return SseTiming(None, None, f"status {int(head[9:12])}")
            while len(seen) < 2:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
                while buf.count(b"\n\n") > len(seen):  # an SSE event ends with a blank line
                    seen.append((time.monotonic() - t0) * 1000)
        return SseTiming(seen[0] if seen else None, seen[1] if len(seen) > 1 else None,
                         None if len(seen) == 2 else f"saw {len(seen)} events")
    except (TimeoutError, OSError, BadResponse, asyncio.IncompleteReadError, ValueError) as exc:
        return SseTiming(None, None, f"{type(exc).__name__}: {exc}")
    finally:
        writer.transport.abort()


def sse_first_event(target: Target, repeats: int = 3, timeout: float = 15.0) -> dict:
    """Median time to the first and the second event over `repeats` fresh (warmed) connections."""
    runs = [asyncio.run(_sse(target, timeout)) for _ in range(repeats)]
    firsts = [r.first_event_ms for r in runs if r.first_event_ms is not None]
    seconds = [r.second_event_ms for r in runs if r.second_event_ms is not None]
    return {
        "first_event_ms": statistics.median(firsts) if firsts else None,
        "second_event_ms": statistics.median(seconds) if seconds else None,
        "runs": len(runs),
        "errors": [r.error for r in runs if r.error],
    }


def curl_download(target: Target, n: int, timeout: float = 300.0) -> Download:
    """The same download with curl (C, OpenSSL) as the client: a Python client tops out near ~120-330 MiB/s on
    these machines, below a good proxy's bulk rate, so the client, not the proxy, would set the figure.
    The clock runs from curl's pre-transfer point (TCP, CONNECT and TLS done) to the last byte; the body must
    be exactly `n` bytes with status 200. Proxy variables of the environment are ignored (explicit or none)."""
    url = f"{target.scheme}://{target.authority}/bytes/{n}"
    cmd = ["curl", "-sS", "--http1.1", "-o", "/dev/null", "--max-time", str(timeout),
           "-w", "%{http_code} %{size_download} %{time_pretransfer} %{time_total}"]
    if target.ca_file:
        cmd += ["--cacert", target.ca_file]
    if target.via_proxy:
        cmd += ["--proxy", f"http://{target.dial[0]}:{target.dial[1]}"]
        if target.proxy_auth:
            cmd += ["--proxy-user", f"{target.proxy_auth[0]}:{target.proxy_auth[1]}"]
    else:
        cmd += ["--noproxy", "*", "--resolve", f"{target.host}:{target.port}:{target.dial[0]}"]
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    try:
        res = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=timeout + 10, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Download(0, 0.0, False, f"curl: {type(exc).__name__}: {exc}")
    try:
        code, size, pre, total = res.stdout.split()
        got, seconds = int(size), float(total) - float(pre)
    except ValueError:
        return Download(0, 0.0, False, f"curl exit {res.returncode}: {res.stderr.strip()[:200]}")
    if code != "200" or got != n or res.returncode != 0:
        return Download(got, seconds, False, f"curl exit {res.returncode}, status {code}, {got} of {n} bytes: "
                        + res.stderr.strip()[:200])
    return Download(got, seconds, True)
