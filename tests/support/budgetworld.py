"""A world for exact-budget tests: an HTTP/1.1 upstream that counts every byte it receives (partial bodies
of cut requests included), a DNS server naming it, a policy with an outbound byte budget and a rule
request budget, gateway processes started on a chosen state backend, and a raw proxy client.

The upstream is raw asyncio (not aiohttp) because the tests compare what reached it with what the
gateway counted: the request head exactly as received, the body de-chunked, and how far a cut body got.
Every address is on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.launcher import LoopbackGateway, launch_loopback, start_all, stop_gateway
from tests.support.loopback import DnsServer, LoopThread, read_request_head
from tests.support.replay_check import assert_config_replays

HOST = "up.test"


@dataclass
class Received:
    """One request as the upstream received it."""

    path: str
    head_len: int
    body_len: int  # payload bytes (de-chunked)
    complete: bool


@dataclass
class CountingUpstream:
    port: int
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    connections: int = 0  # open now: a request cut mid-body is recorded when its connection ends

    def idle(self) -> bool:
        """No connection open: every request that reached the upstream so far is in `received`."""
        with self.lock:
            return self.connections == 0

    def since(self, mark: int) -> list[Received]:
        with self.lock:
            return list(self.received[mark:])

    def mark(self) -> int:
        with self.lock:
            return len(self.received)

    def total(self, mark: int = 0, path_prefix: str = "") -> int:
        return sum(r.head_len + r.body_len for r in self.since(mark) if r.path.startswith(path_prefix))

    def add(self, item: Received) -> None:
        with self.lock:
            self.received.append(item)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self.lock:
            self.connections += 1
        try:
            while True:
                req = await read_request_head(reader)
                if req is None:
                    return
                headers = req.headers
                got = Received(req.path, req.size, 0, False)
                try:
                    if headers.get("transfer-encoding", "").lower() == "chunked":
                        while True:
                            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                            if size == 0:
                                await reader.readuntil(b"\r\n")  # no trailers (the gateway forwards none)
                                break
                            while size:
                                chunk = await reader.read(size)
                                if not chunk:
                                    raise ConnectionError("eof in chunk")
                                got.body_len += len(chunk)
                                size -= len(chunk)
                            await reader.readexactly(2)
                    else:
                        left = int(headers.get("content-length", "0"))
                        while left:
                            chunk = await reader.read(min(left, 65536))
                            if not chunk:
                                raise ConnectionError("eof in body")
                            got.body_len += len(chunk)
                            left -= len(chunk)
                    got.complete = True
                except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                    return
                finally:
                    self.add(got)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with self.lock:
                self.connections -= 1


@dataclass
class BudgetWorld:
    tmp: Path
    upstream: CountingUpstream
    dns_port: int
    loop: LoopThread

    def policy(self, budget: int, requests_max: int, name: str = "exact") -> dict:
        return {"sandbox": {"name": name, "resources": {"outbound_bytes_max": budget}},
                "network": {"allow_private": ["127.0.0.1/32"], "http": {"allow": [
                    {"id": "few", "host": HOST, "ports": [self.upstream.port], "paths": ["/few"],
                     "budget": {"requests": requests_max}},
                    {"id": "up", "host": HOST, "ports": [self.upstream.port],
                     "paths": ["/k", "/c", "/d", "/other"]}]}}}


@contextmanager
def budget_world(tmp: Path) -> Iterator[BudgetWorld]:
    loop = LoopThread()
    upstream = CountingUpstream(0)
    dns = DnsServer()
    dns.records[HOST] = "127.0.0.1"

    async def start():
        server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: dns, local_addr=("127.0.0.1", 0))
        return server, transport

    server, transport = loop.run(start())
    upstream.port = server.sockets[0].getsockname()[1]
    try:
        yield BudgetWorld(tmp, upstream, transport.get_extra_info("sockname")[1], loop)
    finally:
        loop.close(servers=[server], transports=[transport])
    # every gateway the module started (start_gateways: stopped by its test) replays its trail the same
    # under its own policy: byte-budget denials included (issue 23, item 1)
    for config in sorted(tmp.glob("gw*/gateway.yaml")):
        assert_config_replays(config)


def start_gateways(w: BudgetWorld, policy: dict | list[dict], state: dict | None, count: int,
                   launcher: list[str] | None = None) -> list[LoopbackGateway]:
    """`count` gateway processes on the same `state` backend config (None: memory), each its own ports,
    var dir (audit file, CA) and policy copy (one policy, or several: one `<sandbox.name>.yaml` each);
    started at once (launcher.start_all)."""
    import yaml

    docs = policy if isinstance(policy, list) else [policy]

    def start(i: int) -> LoopbackGateway:
        tmp = w.tmp / f"gw{i}-{id(policy)}"
        (tmp / "policies").mkdir(parents=True)
        for doc in docs:
            (tmp / "policies" / f"{doc['sandbox']['name']}.yaml").write_text(yaml.safe_dump(doc))
        config = {"listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
                  "policy": str(tmp / "policies"), "var_dir": str(tmp / "var"),
                  "upstream": {"resolver": f"127.0.0.1:{w.dns_port}"}}
        if state is not None:
            config["state"] = state
        return LoopbackGateway(**launch_loopback(tmp, config, launcher=launcher))

    return start_all([functools.partial(start, i) for i in range(count)], stop_gateway)


def proxy_auth(sandbox_id: str, token: str) -> str:
    return "Proxy-Authorization: Basic " + base64.b64encode(f"{sandbox_id}:{token}".encode()).decode() + "\r\n"


def head(port: int, path: str, framing: str) -> bytes:
    """The request head as the upstream receives it (the gateway strips Proxy-Authorization)."""
    return f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n{framing}\r\n\r\n".encode()


def read_status(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of one response (0 when the connection was cut first)."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return 0, data
            data += chunk
        top, _, rest = data.partition(b"\r\n\r\n")
        m = re.search(rb"(?i)content-length:\s*(\d+)", top)
        want = int(m.group(1)) if m else 0
        while len(rest) < want:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return int(top.split(b" ")[1]), rest
    except OSError:
        return 0, data


def send(proxy: tuple[str, int], auth: str, port: int, path: str, body: bytes | None,
         chunks: list[bytes] | None = None, pause: float = 0.0) -> tuple[int, bytes]:
    """One POST through the explicit proxy (absolute form): Content-Length `body`, or chunked `chunks`."""
    import time

    with socket.create_connection(proxy, timeout=30) as sock:
        target = f"http://{HOST}:{port}{path}"
        framing = "Transfer-Encoding: chunked" if chunks is not None else f"Content-Length: {len(body or b'')}"
        try:
            sock.sendall(f"POST {target} HTTP/1.1\r\nHost: {HOST}:{port}\r\n{auth}{framing}\r\n\r\n".encode())
            if chunks is None:
                sock.sendall(body or b"")
            else:
                for chunk in chunks:
                    sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    if pause:
                        time.sleep(pause)
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            return 0, b""
        return read_status(sock)


def bytes_out(gw: LoopbackGateway, sandbox_id: str) -> int:
    """The store's bytes_out for the sandbox, as the control API shows it (GET /v1/sandboxes/{id})."""
    import httpx

    res = httpx.get(f"http://{gw.admin}/v1/sandboxes/{sandbox_id}", headers={"Authorization": f"Bearer {gw.token}"},
                    timeout=10, trust_env=False)
    assert res.status_code == 200, res.text
    return int(res.json()["usage"]["bytes_out"])
