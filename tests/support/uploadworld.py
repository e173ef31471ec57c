"""Large uploads through the gateway (issue 21 item 2, issue 23 item 6): a counting upstream, its policies,
a gateway, and the real clients that upload to it.

The upstream (`bigdeny.test`, on 127.0.0.1 of the loopback world in tests/support/gwworld.py) records every
TCP connection it accepts, every request head and every body byte as it arrives, so "the upstream saw
nothing" is checked at the strongest level (not even a connection) and a positive control shows the same
upload arriving whole. It listens three times: HTTP/1.1 over TLS, plain HTTP/1.1, and HTTP/2 over TLS (the
gateway mirrors the upstream's ALPN, so a client speaks h2 to the gateway only towards an h2 upstream).

Policies: `gw-bigdeny` allows POST and PUT to `/allowed` only (anything else: `path_not_allowed`);
`gw-bigdeny-budget` the same with `outbound_bytes_max` BUDGET_BYTES.

Clients are the real programs an agent runs: the curl binary, requests and httpx (HTTP/1.1 and HTTP/2);
each returns an `Upload` (status, headers, body, error text) and never raises for a transport error, so a
test can show what the client got.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.config
import h2.events
import h11
import httpx
import requests

from tests.support.gwworld import Gateway, Sandbox, World, start_gateway
from tests.support.h2server import serve_h2_events
from tests.support.loopback import server_context

HOST = "bigdeny.test"
BUDGET_BYTES = 3000
PIECE = 64 * 1024


@dataclass
class Seen:
    """What the counting upstream saw, in order: accept / start / done events (thread-safe)."""

    events: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **event: Any) -> None:
        with self.lock:
            self.events.append(event)

    def mark(self) -> int:
        with self.lock:
            return len(self.events)

    def since(self, mark: int) -> list[dict]:
        with self.lock:
            return list(self.events[mark:])


async def _serve_h1(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen, listener: str) -> None:
    """HTTP/1.1 (h11): every body byte counted as it arrives, answered with its count."""
    seen.add(event="accept", listener=listener)
    conn = h11.Connection(h11.SERVER)
    total, path = 0, ""
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(PIECE)
                conn.receive_data(data)
                if not data and conn.their_state is not h11.DONE:
                    seen.add(event="eof", listener=listener, path=path, body_len=total)
                    return
                continue
            if isinstance(event, h11.Request):
                path, total = event.target.decode(), 0
                seen.add(event="start", listener=listener, method=event.method.decode(), path=path)
            elif isinstance(event, h11.Data):
                total += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                seen.add(event="done", listener=listener, path=path, body_len=total)
                body = json.dumps({"body_len": total}).encode()
                writer.write(
                    conn.send(
                        h11.Response(
                            status_code=200,
                            headers=[("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
                        )
                    )
                )
                writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
                path, total = "", 0  # between requests: an EOF now is no cut request
            elif isinstance(event, h11.ConnectionClosed):
                return
    except (h11.ProtocolError, ConnectionError, OSError) as exc:
        seen.add(event="error", listener=listener, path=path, body_len=total, error=repr(exc))
    finally:
        writer.close()


async def _serve_h2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
    seen.add(event="accept", listener="h2")
    paths: dict[int, str] = {}
    totals: dict[int, int] = {}

    async def on_event(conn, event) -> bool:
        if isinstance(event, h2.events.RequestReceived):
            headers = {k.decode(): v.decode() for k, v in event.headers}
            paths[event.stream_id], totals[event.stream_id] = headers.get(":path", ""), 0
            seen.add(event="start", listener="h2", method=headers.get(":method"), path=paths[event.stream_id])
        elif isinstance(event, h2.events.DataReceived):
            totals[event.stream_id] = totals.get(event.stream_id, 0) + len(event.data)
        elif isinstance(event, h2.events.StreamEnded):
            total = totals.pop(event.stream_id, 0)
            seen.add(event="done", listener="h2", path=paths.pop(event.stream_id, ""), body_len=total)
            body = json.dumps({"body_len": total}).encode()
            conn.send_headers(
                event.stream_id,
                [(":status", "200"), ("content-type", "application/json"), ("content-length", str(len(body)))],
            )
            conn.send_data(event.stream_id, body, end_stream=True)
        return False

    await serve_h2_events(reader, writer, on_event, h2.config.H2Configuration(client_side=False))


@dataclass
class UploadWorld:
    world: World
    gw: Gateway
    seen: Seen
    tls_port: int
    plain_port: int
    h2_port: int
    files: Path
    servers: list = field(default_factory=list)

    def admit(self, policy: str = "gw-bigdeny") -> Sandbox:
        return self.gw.admit(policy)

    def url(self, path: str, kind: str = "tls") -> str:
        if kind == "plain":
            return f"http://{HOST}:{self.plain_port}{path}"
        return f"https://{HOST}:{self.h2_port if kind == 'h2' else self.tls_port}{path}"

    def gateway_pid(self) -> int:
        return self.gw.proc.pid


def policies(tls_port: int, plain_port: int, h2_port: int) -> dict[str, dict]:
    rules = {"methods": ["POST", "PUT"], "paths": ["/allowed"]}

    def doc(name: str, resources: dict | None = None) -> dict:
        sandbox: dict = {"name": name, **({"resources": resources} if resources else {})}
        return {
            "sandbox": sandbox,
            "network": {
                "allow_private": ["127.0.0.1/32"],
                "https": {"allow": [{"id": "upload-tls", "host": HOST, "ports": [tls_port, h2_port], **rules}]},
                "http": {"allow": [{"id": "upload-plain", "host": HOST, "ports": [plain_port], **rules}]},
            },
        }

    return {
        "gw-bigdeny": doc("gw-bigdeny"),
        "gw-bigdeny-budget": doc("gw-bigdeny-budget", {"outbound_bytes_max": BUDGET_BYTES}),
    }


@contextlib.contextmanager
def open_upload_world(world: World, tmp: Path) -> Iterator[UploadWorld]:
    """The counting upstream on `world`'s loop, its DNS name, and a gateway of its own (started here:
    a fresh process, so its peak memory says what these uploads cost)."""
    seen = Seen()
    cert = world.ca.issue_cert(HOST)

    async def start():
        tls = await asyncio.start_server(
            lambda r, w: _serve_h1(r, w, seen, "tls"), "127.0.0.1", 0, ssl=server_context(cert, ["http/1.1"])
        )
        plain = await asyncio.start_server(lambda r, w: _serve_h1(r, w, seen, "plain"), "127.0.0.1", 0)
        h2s = await asyncio.start_server(
            lambda r, w: _serve_h2(r, w, seen), "127.0.0.1", 0, ssl=server_context(cert, ["h2"])
        )
        return [tls, plain, h2s]

    servers = world.loop.run(start())
    tls_port, plain_port, h2_port = (s.sockets[0].getsockname()[1] for s in servers)
    world.dns.records[HOST] = "127.0.0.1"
    policy_dir = tmp / "policies"
    policy_dir.mkdir(parents=True, exist_ok=True)
    for name, doc in policies(tls_port, plain_port, h2_port).items():
        (policy_dir / f"{name}.yaml").write_text(json.dumps(doc))  # JSON is YAML
    files = tmp / "bodies"
    files.mkdir(exist_ok=True)
    gw = start_gateway(world, tmp)
    uw = UploadWorld(
        world=world,
        gw=gw,
        seen=seen,
        tls_port=tls_port,
        plain_port=plain_port,
        h2_port=h2_port,
        files=files,
        servers=servers,
    )
    try:
        yield uw
    finally:
        from tests.support.launcher import stop_gateway

        stop_gateway(gw)

        async def stop():
            for server in servers:
                server.close()

        world.loop.run(stop())


# ------------------------------------------------------------------------------------------- clients
@dataclass
class Upload:
    client: str
    status: int  # 0: no response
    headers: dict[str, str]
    body: bytes
    error: str  # what the client printed or raised
    seconds: float

    def deny(self) -> dict:
        """The deny contract, checked: decision header, JSON body, the request id of the header."""
        assert self.status in (403, 407, 429), self
        assert self.headers.get("x-egressgate-decision") == "deny", self
        doc = json.loads(self.body)
        assert doc["error"] == "egress_denied" and doc["message"], doc
        assert doc["request_id"] == self.headers.get("x-egressgate-request-id"), (doc, self.headers)
        return doc

    def __str__(self) -> str:
        return (
            f"{self.client}: status {self.status} in {self.seconds:.2f}s, body {self.body[:300]!r}, "
            f"error {self.error[-600:]!r}"
        )


def _pieces(size: int) -> Iterator[bytes]:
    """A body of unknown length (an iterator: the Python clients send it chunked / without length)."""
    sent = 0
    while sent < size:
        n = min(PIECE, size - sent)
        yield b"u" * n
        sent += n


def body_file(work: Path, size: int) -> Path:
    """A file of `size` bytes in `work` (made once): curl uploads from it."""
    path = work / f"body-{size}"
    if not path.exists():
        path.write_bytes(b"u" * size)
    return path


def curl_upload(
    url: str,
    size: int,
    *,
    work: Path,
    cacert: str,
    proxy: str | None = None,
    chunked: bool = False,
    expect: bool | None = None,
    http2: bool = False,
    method: str = "POST",
    prefix: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    timeout: float = 60,
) -> Upload:
    """The curl binary uploading `size` bytes. `expect`: None = curl's default (it sends
    `Expect: 100-continue` above 1 MiB and for chunked bodies), True = always, False = never. `proxy`
    (http://id:token@host:port) or none (transparent mode: `prefix` runs curl in the sandbox's namespace)."""
    stamp = time.monotonic_ns()
    out, hdr = work / f"curl-out-{stamp}", work / f"curl-hdr-{stamp}"
    args = [
        "curl",
        "-sS",
        "--max-time",
        str(int(timeout)),
        "--cacert",
        cacert,
        "-o",
        str(out),
        "-D",
        str(hdr),
        "-w",
        "%{http_code}",
        "-X",
        method,
        "--data-binary",
        f"@{body_file(work, size)}",
        "--http2" if http2 else "--http1.1",
    ]
    if proxy is not None:
        args += ["-x", proxy]
    if chunked:
        args += ["-H", "Transfer-Encoding: chunked"]
    if expect is True:
        args += ["-H", "Expect: 100-continue"]
    elif expect is False:
        args += ["-H", "Expect:"]
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    start = time.monotonic()
    res = subprocess.run([*prefix, *args, *extra, url], capture_output=True, text=True, timeout=timeout + 15, env=env)
    seconds = time.monotonic() - start
    body = out.read_bytes() if out.exists() else b""
    head = hdr.read_text(errors="replace") if hdr.exists() else ""
    out.unlink(missing_ok=True)
    hdr.unlink(missing_ok=True)
    blocks = [b for b in head.replace("\r\n", "\n").split("\n\n") if b.strip()]
    final = blocks[-1].splitlines() if blocks else []  # after a CONNECT's 200 and any 1xx
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in final[1:]) if k}
    return Upload("curl", int(res.stdout.strip() or 0), headers, body, res.stderr + f" rc={res.returncode}", seconds)


def curl(uw: UploadWorld, sbx: Sandbox, url: str, size: int, **kw: Any) -> Upload:
    """curl through `uw`'s gateway as `sbx` (curl_upload)."""
    proxy = f"http://{sbx.id}:{sbx.token}@{uw.gw.proxy[0]}:{uw.gw.proxy[1]}"
    return curl_upload(url, size, work=uw.files, cacert=uw.gw.bundle, proxy=proxy, **kw)


def python_upload(
    url: str,
    size: int,
    *,
    client: str,
    cafile: str,
    proxy: str | None = None,
    chunked: bool = False,
    expect: bool = False,
    method: str = "POST",
    timeout: float = 60,
) -> Upload:
    """requests, httpx (HTTP/1.1) or httpx2 (httpx with HTTP/2) uploading `size` bytes: as bytes (a
    Content-Length) or as an iterator (`chunked`: chunked on HTTP/1.1, no length on HTTP/2)."""
    data: Any = _pieces(size) if chunked else b"u" * size
    headers = {"Expect": "100-continue"} if expect else {}
    start = time.monotonic()
    try:
        if client == "requests":
            with requests.Session() as s:
                s.trust_env = False
                r = s.request(
                    method,
                    url,
                    data=data,
                    headers=headers,
                    verify=cafile,
                    timeout=(10, timeout),
                    proxies={"http": proxy, "https": proxy} if proxy else None,
                )
                status, rh, body = r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content
        else:
            with httpx.Client(
                proxy=proxy,
                verify=ssl.create_default_context(cafile=cafile),
                trust_env=False,
                http2=client == "httpx2",
                timeout=timeout,
            ) as c:
                r = c.request(method, url, content=data, headers=headers)
                status, rh, body = r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content
                if client == "httpx2" and r.http_version != "HTTP/2":
                    raise AssertionError(f"httpx spoke {r.http_version}, not HTTP/2")
        error = ""
    except AssertionError:
        raise
    except Exception as exc:  # what the agent would see
        status, rh, body, error = 0, {}, b"", f"{type(exc).__name__}: {exc}"
    return Upload(client, status, rh, body, error, time.monotonic() - start)


def python_client(uw: UploadWorld, sbx: Sandbox, url: str, size: int, *, client: str, **kw: Any) -> Upload:
    """python_upload through `uw`'s gateway as `sbx`."""
    proxy = f"http://{sbx.id}:{sbx.token}@{uw.gw.proxy[0]}:{uw.gw.proxy[1]}"
    return python_upload(url, size, client=client, cafile=uw.gw.bundle, proxy=proxy, **kw)
