"""A raw-TCP relay carries a half-close: the client's FIN goes up, the server's reply still comes back.

Request/response protocols over raw TCP (a client that sends its request, then `shutdown(SHUT_WR)`, then
reads until EOF: netcat, rsync-style pipes, many test probes) depend on it. The upstream here answers
only after it has read EOF, so a relay that closes the client when the client's FIN arrives (instead of
forwarding the FIN and waiting for the other side) leaves the client with b"". Both raw-TCP paths of the
explicit proxy are covered: a CONNECT allowed only by a `network.tcp` rule (the relay starts at once) and a
CONNECT allowed by an https rule whose bytes turn out not to be TLS/HTTP (layers/next_layer.py's raw-TCP decision).
Positive controls: a client that keeps its sending side open gets the reply too (the upstream is live and
the relay works), and the outcome record counts the bytes exactly in both directions.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import yaml

from tests.support.gwworld import Gateway, connect_tunnel, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

REQUEST = b"\x00\x01 raw request bytes"
TERMINATOR = b"\n"
BANNER = b"banner: say something, then close\n"


class ReplyAfterEof:
    """Reads a request until EOF (or, for the control, until a newline), then answers `reply:<request>` and
    closes. Records what it read. `banner_first`: the other direction: it first sends a banner and
    half-closes (`shutdown(SHUT_WR)`), then reads the client's request until EOF and records it."""

    def __init__(self, banner_first: bool = False) -> None:
        self.banner_first = banner_first
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(sock,), daemon=True).start()

    def _one(self, sock: socket.socket) -> None:
        with sock:
            sock.settimeout(10)
            data = b""
            try:
                if self.banner_first:
                    sock.sendall(BANNER)
                    sock.shutdown(socket.SHUT_WR)
                    while chunk := sock.recv(65536):
                        data += chunk
                    self.seen.append(data)
                    return
                while not data.endswith(TERMINATOR) and (chunk := sock.recv(65536)):
                    data += chunk
                self.seen.append(data)
                sock.sendall(b"reply:" + data)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[ReplyAfterEof]:
    server = ReplyAfterEof()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def banner_upstream() -> Iterator[ReplyAfterEof]:
    server = ReplyAfterEof(banner_first=True)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def gw(world, upstream, banner_upstream, tmp_path_factory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-half-close")
    (tmp / "policies").mkdir()
    port = upstream.port
    (tmp / "policies" / "half-close.yaml").write_text(yaml.safe_dump({
        "sandbox": {"name": "half-close"},
        "network": {"allow_private": ["127.0.0.1/32"],
                    # open.test: https allows the CONNECT (intercepted), tcp allows its raw bytes
                    "https": {"allow": [{"id": "open-https", "host": "open.test", "ports": [port]}]},
                    "tcp": {"allow": [{"id": "raw", "host": "tcp.test", "ports": [port]},
                                      {"id": "open-raw", "host": "open.test", "ports": [port]},
                                      {"id": "banner", "host": "tcp.test", "ports": [banner_upstream.port]}]}},
    }))
    gateway = start_gateway(world, tmp)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


def read_until_eof(sock: socket.socket, timeout: float = 5) -> bytes:
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


def outcome(gw: Gateway, sandbox_id: str) -> dict:
    def find():
        return [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox_id
                and r.get("egressgate.operation") == "outcome"]
    assert wait_for(find, timeout=5), "no outcome record"
    [record] = find()
    return record


@pytest.mark.parametrize("host", ["tcp.test", "open.test"])
@pytest.mark.parametrize("half_close", [True, False])
def test_reply_after_client_half_close_reaches_the_client(gw, upstream, host, half_close):
    sbx = gw.admit("half-close")
    sock, head = connect_tunnel(gw, sbx, f"{host}:{upstream.port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    with sock:
        if half_close:
            sock.sendall(REQUEST)
            sock.shutdown(socket.SHUT_WR)
            sent = REQUEST
        else:  # control: same bytes, the client's sending side stays open (the newline ends the request)
            sent = REQUEST + TERMINATOR
            sock.sendall(sent)
        got = read_until_eof(sock)
    assert got == b"reply:" + sent
    assert upstream.seen[-1] == sent
    record = outcome(gw, sbx.id)
    assert record["egressgate.decision"] == "allow"
    assert (int(record["egressgate.bytes.out"]), int(record["egressgate.bytes.in"])) == (len(sent), len(got))


@pytest.mark.parametrize("send_after_eof", [True, False])
def test_client_still_sends_after_the_upstream_half_closed(gw, banner_upstream, send_after_eof):
    """The other direction: the upstream sends its banner and half-closes; the client reads it to EOF and
    only then sends its request, which must still reach the upstream (mitmproxy's relay closed the client
    outright, so the request never left). Control: a request sent before reading the banner arrives
    either way (the upstream is live and reads until EOF)."""
    sbx = gw.admit("half-close")
    sock, head = connect_tunnel(gw, sbx, f"tcp.test:{banner_upstream.port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    before = len(banner_upstream.seen)
    early = head.split(b"\r\n\r\n", 1)[1]  # a banner in the same read as the CONNECT's 200
    with sock:
        if not send_after_eof:
            sock.sendall(REQUEST)
        got = early + read_until_eof(sock)
        if send_after_eof:
            sock.sendall(REQUEST)
        sock.shutdown(socket.SHUT_WR)
        assert read_until_eof(sock, 2) == b""
    assert got == BANNER
    assert wait_for(lambda: len(banner_upstream.seen) > before, timeout=5)
    assert banner_upstream.seen[before:] == [REQUEST]
    record = outcome(gw, sbx.id)
    assert (int(record["egressgate.bytes.out"]), int(record["egressgate.bytes.in"])) == (len(REQUEST), len(BANNER))
