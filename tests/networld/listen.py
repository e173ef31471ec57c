"""The world's TCP listeners: canaries, upstreams (HTTP/1.1, HTTP/2, TLS, raw), in one process.

Run by tests/networld as ``ip netns exec NS python listen.py SPEC.json``: a threaded server bound to many
(address, port) pairs at once. Every listener records *every* accepted connection in a JSON-lines log
before reading a byte, so a test can assert "canary untouched" at the strongest level (no TCP connection
at all), and records every parsed HTTP request (method, target, Host, SNI, headers, body prefix) so
domain fronting, Host spoofing and request smuggling can be detected on the receiving side. The HTTP
parser is deliberately lenient (obfuscated ``Transfer-Encoding`` still counts as chunked) and its
framing preference is configurable per listener (``te`` or ``cl``) so that a gateway which forwards
ambiguous framing *would* desynchronise it: the smuggled request then shows up as its own request.

Prints ``READY`` once every socket is bound. Blocking threads, because a TLS listener must peek at the
first byte before deciding whether to handshake, and must log the TCP accept even when TLS never happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

MAX_HEAD = 65536


class JsonLog:
    """Append-only JSON-lines log shared by all threads of one server process."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def write(self, **record: Any) -> None:
        record.setdefault("t", time.time())
        line = json.dumps(record, sort_keys=True) + "\n"
        with self._lock, open(self._path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()


@dataclass
class Listener:
    """One bound socket and how to treat what arrives on it."""

    name: str
    host: str
    port: int
    kind: str = "http"  # http | raw | banner (raw, server speaks first)
    tls: bool = False
    framing: str = "te"  # te: Transfer-Encoding wins (RFC 9112); cl: Content-Length wins
    banner: str = ""  # body prefix of every HTTP response (canaries say "CANARY:<name>")
    alpn: list[str] = field(default_factory=lambda: ["http/1.1"])  # ["h2", "http/1.1"] for HTTP/2


# ---------------------------------------------------------------------------------------------- HTTP


def _read_head(conn: socket.socket | ssl.SSLSocket, buf: bytearray) -> bytes | None:
    """Read until the end of a header block; returns the head, leaves the rest in ``buf``."""
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEAD:
            return None
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buf.extend(chunk)
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    buf[:] = rest
    return head


def _read_exact(conn: socket.socket | ssl.SSLSocket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf.extend(chunk)
    data = bytes(buf[:n])
    del buf[:n]
    return data


def _read_line(conn: socket.socket | ssl.SSLSocket, buf: bytearray) -> bytes:
    while b"\r\n" not in buf and b"\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            line = bytes(buf)
            buf.clear()
            return line
        buf.extend(chunk)
    idx = buf.find(b"\n")
    line = bytes(buf[: idx + 1])
    del buf[: idx + 1]
    return line


def _read_chunked(conn: socket.socket | ssl.SSLSocket, buf: bytearray) -> bytes:
    body = bytearray()
    while True:
        size_line = _read_line(conn, buf).strip()
        if not size_line:
            return bytes(body)
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return bytes(body)
        if size == 0:
            # trailers until an empty line
            while _read_line(conn, buf).strip():
                pass
            return bytes(body)
        body.extend(_read_exact(conn, buf, size))
        _read_line(conn, buf)


def _is_chunked(headers: list[tuple[str, str]]) -> bool:
    """Lenient on purpose: any Transfer-Encoding-ish header that mentions chunked counts."""
    return any(
        name.strip().lower() == "transfer-encoding" and "chunked" in value.lower() for name, value in headers
    )


def _content_length(headers: list[tuple[str, str]]) -> int | None:
    for name, value in headers:
        if name.strip().lower() == "content-length":
            with contextlib.suppress(ValueError):
                return int(value.strip().split(",")[0])
    return None


def _respond(conn: socket.socket | ssl.SSLSocket, status: str, body: bytes, extra: list[str]) -> None:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Content-Type: application/json"]
    lines += extra
    conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)


def _route(lst: Listener, method: str, target: str, info: dict[str, Any]) -> tuple[str, bytes, list[str]]:
    """Tiny fixed router: redirects for the redirect tests, an echo of what arrived otherwise."""
    parts = urlsplit(target)
    path = parts.path or target
    if path == "/redirect-metadata":
        return "302 Found", b"{}", ["Location: http://169.254.169.254/latest/meta-data/"]
    if path == "/redirect":
        to = parse_qs(parts.query).get("to", ["/"])[0]
        return "302 Found", b"{}", [f"Location: {to}"]
    body = json.dumps({"banner": lst.banner, "listener": lst.name, "method": method, **info}).encode()
    return "200 OK", body, []


def serve_http(
    conn: socket.socket | ssl.SSLSocket, lst: Listener, log: JsonLog, peer: str, sni: str | None
) -> None:
    buf = bytearray()
    while True:
        head = _read_head(conn, buf)
        if head is None:
            if buf:
                data = bytes(buf[:512]).decode("latin-1")
                log.write(listener=lst.name, event="garbage", peer=peer, data=data)
            return
        lines = head.decode("latin-1").split("\r\n")
        request_line = lines[0]
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers.append((name, value.strip()))
        parts = request_line.split(" ")
        method, target = (parts[0], parts[1]) if len(parts) >= 2 else (request_line, "")
        chunked, length = _is_chunked(headers), _content_length(headers)
        if lst.framing == "cl" and length is not None:
            body = _read_exact(conn, buf, length)
        elif chunked:
            body = _read_chunked(conn, buf)
        elif length is not None:
            body = _read_exact(conn, buf, length)
        else:
            body = b""
        host = next((v for n, v in headers if n.strip().lower() == "host"), None)
        info = {"target": target, "host": host, "sni": sni, "peer": peer}
        log.write(
            listener=lst.name,
            event="request",
            method=method,
            request_line=request_line,
            headers=headers,
            body=body[:2048].decode("latin-1"),
            body_len=len(body),
            **info,
        )
        if urlsplit(target).path == "/switch":  # 101 to a non-HTTP protocol, then raw bytes
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: exfil\r\nConnection: Upgrade\r\n\r\n")
            if buf:
                log.write(listener=lst.name, event="data", peer=peer, data=bytes(buf).decode("latin-1"))
            serve_raw(conn, lst, log, peer)
            return
        status, rbody, extra = _route(lst, method, target, info)
        _respond(conn, status, rbody, extra)
        if any(n.lower() == "connection" and v.lower() == "close" for n, v in headers):
            return


def serve_h2(conn: ssl.SSLSocket, lst: Listener, log: JsonLog, peer: str, sni: str | None) -> None:
    """Minimal HTTP/2 server: logs every stream's pseudo-headers, answers each with a small JSON."""
    import h2.config
    import h2.connection
    import h2.events

    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    h2c.initiate_connection()
    conn.sendall(h2c.data_to_send())
    while True:
        data = conn.recv(65536)
        if not data:
            return
        for event in h2c.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                headers = [(str(k), str(v)) for k, v in event.headers]
                pseudo = {k: v for k, v in headers if k.startswith(":")}
                host = next((v for k, v in headers if k == "host"), None)
                log.write(listener=lst.name, event="request", method=pseudo.get(":method"),
                          target=pseudo.get(":path"), authority=pseudo.get(":authority"), host=host,
                          sni=sni, peer=peer, headers=headers, body="", stream=event.stream_id)
                body = json.dumps({"listener": lst.name, "authority": pseudo.get(":authority")}).encode()
                h2c.send_headers(event.stream_id, [(":status", "200"), ("content-length", str(len(body)))])
                h2c.send_data(event.stream_id, body, end_stream=True)
        conn.sendall(h2c.data_to_send())


def serve_raw(conn: socket.socket, lst: Listener, log: JsonLog, peer: str) -> None:
    while True:
        data = conn.recv(65536)
        if not data:
            return
        text = data[:2048].decode("latin-1")
        log.write(listener=lst.name, event="data", peer=peer, data=text, size=len(data))
        conn.sendall(b"RAW-ACK %d\n" % len(data))


def handle(
    conn: socket.socket, addr: Any, lst: Listener, log: JsonLog, tls_ctx: ssl.SSLContext | None
) -> None:
    peer = f"{addr[0]}:{addr[1]}"
    log.write(listener=lst.name, event="accept", peer=peer)
    conn.settimeout(10)
    try:
        if lst.kind in ("raw", "banner"):
            if lst.kind == "banner":  # server-first protocol (SMTP, MySQL, FTP): speaks before the client
                conn.sendall(b"BANNER %s\n" % lst.name.encode())
            serve_raw(conn, lst, log, peer)
            return
        sni: str | None = None
        if lst.tls and tls_ctx is not None:
            first = conn.recv(1, socket.MSG_PEEK)
            if first != b"\x16":
                data = conn.recv(2048)
                log.write(listener=lst.name, event="non_tls", peer=peer, data=data.decode("latin-1"))
                return
            seen: dict[str, str | None] = {}

            def on_sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
                seen["sni"] = name

            tls_ctx.sni_callback = on_sni  # type: ignore[assignment]
            tconn = tls_ctx.wrap_socket(conn, server_side=True)
            sni = seen.get("sni")
            alpn = tconn.selected_alpn_protocol()
            log.write(listener=lst.name, event="tls", peer=peer, sni=sni, alpn=alpn)
            if alpn == "h2":
                serve_h2(tconn, lst, log, peer, sni)
            else:
                serve_http(tconn, lst, log, peer, sni)
        else:
            serve_http(conn, lst, log, peer, None)
    except (OSError, ssl.SSLError) as exc:
        log.write(listener=lst.name, event="error", peer=peer, error=repr(exc))
    finally:
        with contextlib.suppress(OSError):
            conn.close()


def run_listen(spec: dict[str, Any]) -> None:
    log = JsonLog(spec["log"])
    listeners = [Listener(**item) for item in spec["listeners"]]
    sockets: list[tuple[socket.socket, Listener]] = []
    for lst in listeners:
        family = socket.AF_INET6 if ":" in lst.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((lst.host, lst.port))
        sock.listen(128)
        sockets.append((sock, lst))

    def tls_context(alpn: list[str]) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(spec["cert"], spec["key"])
        ctx.set_alpn_protocols(alpn)
        return ctx

    def accept_loop(sock: socket.socket, lst: Listener) -> None:
        while True:
            conn, addr = sock.accept()
            ctx = tls_context(lst.alpn) if lst.tls else None  # per connection: the SNI callback is per context
            threading.Thread(target=handle, args=(conn, addr, lst, log, ctx), daemon=True).start()

    for sock, lst in sockets:
        threading.Thread(target=accept_loop, args=(sock, lst), daemon=True).start()
    print("READY", flush=True)
    threading.Event().wait()


def main(argv: list[str]) -> int:
    run_listen(json.loads(Path(argv[1]).read_text()))
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main(sys.argv))
