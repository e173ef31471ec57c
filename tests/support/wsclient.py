"""A raw WebSocket client (wsproto on a blocking TLS socket) for frame-level tests through the gateway.

aiohttp and friends hide the frames (automatic pongs, no control over FIN); these tests need to send
exactly the frames an attacker would: many pings, continuation frames without FIN, a phantom in a
ping, and to read every Ping/Pong/Close the gateway relays.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import ssl
import time

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Message,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)

from tests.support.http1 import read_head


def open_tunnel(proxy: tuple[str, int], sandbox_id: str, token: str, target: str, bundle: str,
                sni: str, source: str | None = None) -> ssl.SSLSocket:
    """CONNECT through the gateway, then TLS to `sni` (the gateway's interception certificate). `source`:
    the local address to send from (a token admitted with addresses works only from those)."""
    sock = socket.create_connection(proxy, timeout=10, source_address=(source, 0) if source else None)
    auth = base64.b64encode(f"{sandbox_id}:{token}".encode()).decode()
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
    head = read_head(sock)  # the gateway sends nothing past its 200 until our ClientHello: no byte is lost
    assert head.startswith(b"HTTP/1.1 200"), head[:300]
    return ssl.create_default_context(cafile=bundle).wrap_socket(sock, server_hostname=sni)


class WsClient:
    """One websocket over `sock`. `closed` is the Close the peer sent (None while open); `gone` says
    the connection ended (EOF or reset), with or without a Close."""

    def __init__(self, sock: ssl.SSLSocket, host: str, path: str, headers: list[tuple[str, str]] | None = None):
        self.sock = sock
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.closed: CloseConnection | None = None
        self.gone = False
        self.pending: list[Event] = []
        extra = [(k.encode(), v.encode()) for k, v in headers or []]
        sock.sendall(self.ws.send(Request(host=host, target=path, extra_headers=extra)))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for ev in self._read(deadline - time.monotonic()):
                if isinstance(ev, AcceptConnection):
                    return
                if isinstance(ev, RejectConnection):
                    raise AssertionError(f"websocket rejected: {ev.status_code}")
                self.pending.append(ev)
        raise AssertionError("no websocket handshake answer")

    def _read(self, timeout: float) -> list[Event]:
        self.sock.settimeout(max(timeout, 0.01))
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return []
        except (ConnectionError, ssl.SSLError, OSError):
            data = b""
        if not data:
            self.gone = True
            self.ws.receive_data(None)
        else:
            self.ws.receive_data(data)
        out = []
        for ev in self.ws.events():
            if isinstance(ev, CloseConnection) and self.closed is None:
                self.closed = ev
            out.append(ev)
        return out

    def send(self, event: Event) -> bool:
        """Send one event; False when the gateway has already closed or reset the connection."""
        if self.gone or self.closed is not None:
            return False
        try:
            self.sock.sendall(self.ws.send(event))
            return True
        except (ConnectionError, ssl.SSLError, OSError):
            self.gone = True
            return False

    def poll(self) -> list[Event]:
        """Whatever has arrived so far, without waiting."""
        out, self.pending = self.pending, []
        if not self.gone:
            out += self._read(0.01)
        return out

    def receive(self, timeout: float = 5.0, until=None) -> list[Event]:
        """Events until `until(event)` is true, the connection ends, or `timeout`."""
        out, self.pending = self.pending, []
        if until is not None and any(until(e) for e in out):
            return out
        deadline = time.monotonic() + timeout
        while not self.gone and time.monotonic() < deadline:
            evs = self._read(deadline - time.monotonic())
            out += evs
            if any(isinstance(e, CloseConnection) for e in evs) or (until is not None and any(until(e) for e in evs)):
                break
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


__all__ = ["BytesMessage", "CloseConnection", "Message", "Ping", "Pong", "TextMessage", "WsClient", "open_tunnel"]
