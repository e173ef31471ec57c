"""Raw HTTP/1.1 on a socket: what the tests send and read when a library would hide or refuse it.

Two readers, on purpose:
- `read_response` (-> `Response`) raises when no response head arrives: the escape tests treat a missing
  answer as an error to explain.
- `read_reply` (-> `(status, headers, body)`) returns status 0 when the peer closed before a head: the
  loopback gateway tests assert on "closed without an answer" as a value.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
from dataclasses import dataclass
from typing import Any


@dataclass
class Response:
    """A parsed HTTP/1.1 response head (+ body when framed by Content-Length or close)."""

    status: int
    reason: str
    headers: dict[str, str]
    body: bytes
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def denied(self) -> bool:
        return self.headers.get("x-egressgate-decision") == "deny"


def read_all(sock: socket.socket, wait: float, first: float | None = None) -> bytes:
    """Read until close or `wait` seconds of quiet. `first` (when an answer is expected) is the
    patience for the first byte, so a loaded CI machine does not turn a slow answer into none."""
    sock.settimeout(first if first is not None else wait)
    out = bytearray()
    with contextlib.suppress(TimeoutError, ConnectionResetError, ssl.SSLError, OSError):
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out.extend(chunk)
            sock.settimeout(wait)
    return bytes(out)


def read_response(sock: socket.socket | ssl.SSLSocket, timeout: float = 10) -> Response:
    """Read one response; Content-Length framed (or until close when absent)."""
    sock.settimeout(timeout)
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf.extend(chunk)
    return parse_response(bytes(buf), sock)


def parse_response(data: bytes, sock: socket.socket | ssl.SSLSocket | None = None) -> Response:
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        raise ConnectionError(f"no HTTP response head, got {data[:200]!r}")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = bytearray(rest)
    length = headers.get("content-length")
    status = int(parts[1])
    if sock is not None and length is not None:
        while len(body) < int(length):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body.extend(chunk)
    return Response(status, parts[2] if len(parts) > 2 else "", headers, bytes(body), data)


def read_head(sock) -> bytes:
    """Bytes up to and past the end of the head (what the last recv brought); all there was if it closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def read_reply(sock, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Read one HTTP/1.1 response (Content-Length or close-delimited); status 0 when no head came."""
    sock.settimeout(timeout)
    head, _, body = read_head(sock).partition(b"\r\n\r\n")
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
