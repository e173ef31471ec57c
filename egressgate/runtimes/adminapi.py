"""The few admin API calls `sandbox run` and `sandbox gc` make (admit, revoke with the outcome), over a
plain socket: the admin API is a loopback HTTP/1.1 listener answering small JSON bodies, and urllib's
opener machinery (handlers, proxy discovery, ssl) cost more start-up time than the whole call
(loadtests/runtime_startup_bench.py). Never through a proxy: the admin token must not leave the host.
"""

from __future__ import annotations

import json
import socket

MAX_RESPONSE = 1 << 25  # the admission answer is a few KiB; a persistent write's approval lists every change


class AdminUnreachable(RuntimeError):
    """The admin API did not answer (or answered something that is not HTTP/JSON)."""


def call(admin: tuple[str, int], method: str, path: str, token: str, body: dict | None = None,
         timeout: float = 10.0) -> tuple[int, dict]:
    """One request; returns (status, JSON body). A 4xx/5xx is returned, not raised: its body says why."""
    host, port = admin
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {path} HTTP/1.1\r\nHost: {'[' + host + ']' if ':' in host else host}:{port}\r\n"
            f"Authorization: Bearer {token}\r\nConnection: close\r\nContent-Length: {len(data)}\r\n")
    if body is not None:
        head += "Content-Type: application/json\r\n"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(head.encode("latin-1") + b"\r\n" + data)
            raw = b""
            while len(raw) <= MAX_RESPONSE:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
    except OSError as exc:
        raise AdminUnreachable(f"admin API unreachable at {host}:{port}: {exc}") from None
    header, sep, payload = raw.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if not sep or len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise AdminUnreachable(f"admin API at {host}:{port} answered something that is not HTTP: {raw[:80]!r}")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if "chunked" in fields.get("transfer-encoding", "").lower():
        raise AdminUnreachable(f"admin API at {host}:{port} sent a chunked answer (not expected)")
    if fields.get("content-length", "").isdigit():
        payload = payload[: int(fields["content-length"])]
    try:
        decoded = json.loads(payload) if payload else {}
    except ValueError:
        decoded = {"error": payload.decode("utf-8", "replace")[:500]}
    return int(parts[1]), decoded if isinstance(decoded, dict) else {"error": str(decoded)[:500]}
