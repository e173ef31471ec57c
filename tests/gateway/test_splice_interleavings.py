"""The passthrough take-over loses no byte and no EOF, whatever mitmproxy holds when it happens: forced, not hoped for.

test_splice_takeover.py finds races with a busy client and 40 tries, on a loaded machine only (one run
in 40 on main; 2 of 2 tries with same-pass hook completion): the upstream got the ClientHello and a
clean EOF, nothing of what the client sent after it. Measured cause (outcome records `closed before
the server's hello`, bytes_in 0): the loaded upstream answered after the client's FIN, and a FIN before
the server's hello closed the tunnel with the bytes held for that hello. Read from mitmproxy's code, a
second way to lose them: mitmproxy's reader task takes a chunk out of the socket's StreamReader and then
waits (for the connection's lock, behind other events) before the chunk reaches the layer. The
take-over looked only at the StreamReader, found it empty and moved the sockets to the splice; the
splice then relayed newer bytes and the peer's FIN, and mitmproxy's late write of the held chunk raised
(a write after the FIN): the chunk was lost, or, without a FIN yet, written out of order.

Here the gateway runs through splice_gate_launcher.py, which forces each interleaving: it holds exactly
that chunk in mitmproxy's reader task while the take-over runs, and releases it only after the splice
(if it took over) has passed on that side's FIN; or it holds the server's hello until the layer has
handled the client's FIN. On main every run of those cases fails. Each case asserts what each end
received, byte for byte, and (for the held chunks) that the tunnel was still spliced once mitmproxy had
handed the chunk on (the fix must not just turn the splice off). The client's EOF read and not yet
handled at the take-over was already guarded; kept as a regression case.

The held-behind-a-FIN path must not become a way around the SNI check: bytes held there are judged like
any that follow a ClientHello, so a second ClientHello naming another host, sent with the FIN before the
server asks for a retry (HelloRetryRequest), is refused, never relayed (it was already; a regression case,
shown failing with the held bytes sent up unjudged).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.gwworld import connect_tunnel, start_gateway
from tests.support.launcher import stop_gateway

LAUNCHER = Path(__file__).with_name("splice_gate_launcher.py")
RUNS = 3  # each interleaving is forced: every run fails on a gateway that has the race
_HELLO_BODY = b"\x02" + (38).to_bytes(3, "big") + b"\x03\x03" + b"\x11" * 32 + b"\x00" * 4
SERVER_HELLO = b"\x16\x03\x03" + struct.pack("!H", len(_HELLO_BODY)) + _HELLO_BODY
HANG_GUARD = 60  # seconds: a hang guard only, never a speed check


@pytest.fixture(scope="module")
def upstream(world):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(HANG_GUARD)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def gw(world, upstream, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-interleavings")
    gate = tmp / "gate"
    gate.mkdir()
    (tmp / "policies").mkdir()
    doc = {
        "sandbox": {"name": "gated"},
        "network": {
            "allow_private": ["127.0.0.1/32"],
            "https": {
                "allow": [
                    {"id": "gated", "host": "*.gate.test", "ports": [upstream.getsockname()[1]], "tls": "passthrough"}
                ]
            },
        },
    }
    (tmp / "policies" / "gated.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    gateway = start_gateway(world, tmp, launcher=[sys.executable, str(LAUNCHER), str(gate)])
    gateway.gate_dir = gate  # type: ignore[attr-defined]
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


def client_hello(world, host: str) -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    ctx = ssl.create_default_context(cadata=world.ca.cert_pem.bytes().decode())
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=host)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def recv_all(sock: socket.socket) -> bytes:
    buf = b""
    while chunk := sock.recv(65536):
        buf += chunk
    return buf


def log_tail(gw, lines: int = 40) -> str:
    """The gateway's last log lines, for an assertion's message (a failure here must explain itself)."""
    return "\n".join(Path(gw.stderr_path).read_text(errors="replace").splitlines()[-lines:])


def gate_says(gw, name: str) -> str:
    """What the gateway's gate wrote (a condition the gateway reaches; the deadline is a hang guard)."""
    path = gw.gate_dir / name
    deadline = time.monotonic() + HANG_GUARD
    while not path.exists():
        assert time.monotonic() < deadline, f"the gate never wrote {name}; gateway log:\n{log_tail(gw)}"
        time.sleep(0.005)
    return path.read_text()


class Tunnel:
    """A CONNECT tunnel through the gateway to `host` and the upstream end of it (the test is both)."""

    def __init__(self, gw, world, upstream: socket.socket, mode: str, run: int) -> None:
        self.host = f"{mode}-{run}.gate.test"
        world.dns.records[self.host] = "127.0.0.1"
        self.hello = client_hello(world, self.host)
        self.client, head = connect_tunnel(gw, gw.sandbox, f"{self.host}:{upstream.getsockname()[1]}")
        assert head.startswith(b"HTTP/1.1 200"), head
        self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.settimeout(HANG_GUARD)
        self.upstream_srv = upstream
        self.up: socket.socket | None = None

    def accept(self) -> socket.socket:
        self.up = self.upstream_srv.accept()[0]
        self.up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.up.settimeout(HANG_GUARD)
        return self.up

    def handshake(self) -> socket.socket:
        """ClientHello up, the server's hello back: the layer now relays and asks for the take-over."""
        self.client.sendall(self.hello)
        up = self.accept()
        assert recv_exactly(up, len(self.hello)) == self.hello
        up.sendall(SERVER_HELLO)
        assert recv_exactly(self.client, len(SERVER_HELLO)) == SERVER_HELLO
        return up

    def close(self) -> None:
        for sock in (self.client, self.up):
            if sock is not None:
                sock.close()


@pytest.fixture
def tunnels(gw, world, upstream):
    gw.sandbox = getattr(gw, "sandbox", None) or gw.admit("gated")
    opened: list[Tunnel] = []

    def open_tunnel(mode: str, run: int) -> Tunnel:
        opened.append(Tunnel(gw, world, upstream, mode, run))
        return opened[-1]

    yield open_tunnel
    for each in opened:
        each.close()
    print(log_tail(gw, 80))  # pytest shows it for a failed test only (a hang guard's timeout too)


@pytest.mark.parametrize("run", range(RUNS))
def test_a_client_chunk_mitmproxy_holds_at_the_take_over_goes_up_in_order(gw, tunnels, run):
    t = tunnels("client-data", run)
    up = t.handshake()
    first, second = b"\x17" * 3000, b"\x18" * 5000
    t.client.sendall(first)  # read by mitmproxy's reader task and held there while the take-over runs
    outcome = gate_says(gw, t.host)
    assert outcome in ("spliced", "declined")
    assert gate_says(gw, f"{t.host}.spliced") == "spliced"  # the splice still takes the tunnel over
    t.client.sendall(second)  # through the splice
    t.client.shutdown(socket.SHUT_WR)
    got = recv_all(up)
    up.sendall(b"done")
    up.close()
    assert recv_all(t.client) == b"done", log_tail(gw)
    # after the ClientHello: every byte, in order
    assert got == first + second, (outcome, len(got), got[:8], log_tail(gw))


@pytest.mark.parametrize("run", range(RUNS))
def test_an_upstream_chunk_mitmproxy_holds_at_the_take_over_reaches_the_client_in_order(gw, tunnels, run):
    t = tunnels("server-data", run)
    up = t.handshake()
    first, second = b"\x17" * 3000, b"\x18" * 5000
    up.sendall(first)  # held in mitmproxy's reader task of the upstream socket while the take-over runs
    outcome = gate_says(gw, t.host)
    assert outcome in ("spliced", "declined")
    assert gate_says(gw, f"{t.host}.spliced") == "spliced"
    up.sendall(second)
    up.shutdown(socket.SHUT_WR)
    got = recv_all(t.client)
    t.client.shutdown(socket.SHUT_WR)
    assert recv_all(up) == b"", log_tail(gw)
    assert got == first + second, (outcome, len(got), got[:8], log_tail(gw))


@pytest.mark.parametrize("run", range(RUNS))
def test_a_client_eof_mitmproxy_holds_at_the_take_over_is_passed_on_once(gw, tunnels, run):
    """The EOF read and not yet handled: the take-over must leave the tunnel to mitmproxy (taken from
    under it, the EOF would be lost or seen twice). Guarded before this fix too; kept as a regression."""
    t = tunnels("client-eof", run)
    up = t.handshake()
    t.client.shutdown(socket.SHUT_WR)
    assert gate_says(gw, t.host) == "declined"
    assert recv_all(up) == b"", log_tail(gw)  # the FIN came up, nothing else
    up.sendall(b"done")  # the other direction still works after the half-close
    up.close()
    assert recv_all(t.client) == b"done", log_tail(gw)


@pytest.mark.parametrize("run", range(RUNS))
def test_a_client_half_close_before_the_servers_hello_still_sends_its_bytes_up(gw, tunnels, run):
    """ClientHello, more bytes, FIN, all before the server answers (the gate holds the server's hello
    until the layer has handled the FIN): the held bytes go up after the hello, then the FIN, and the
    upstream's answer still reaches the client. Before the fix the tunnel was closed with the bytes."""
    t = tunnels("fin-before-hello", run)
    early = b"\x17" * 1400
    t.client.sendall(t.hello + early)
    t.client.shutdown(socket.SHUT_WR)
    up = t.accept()
    assert recv_exactly(up, len(t.hello)) == t.hello
    up.sendall(SERVER_HELLO)
    got = recv_all(up)
    up.sendall(b"done")
    up.close()
    assert got == early, (len(got), log_tail(gw))
    assert recv_all(t.client) == SERVER_HELLO + b"done", log_tail(gw)


# RFC 8446 4.1.3: a ServerHello whose random is this is a HelloRetryRequest
HRR_RANDOM = bytes.fromhex("CF21AD74E59A6111BE1D8C021E65B891C2A211167ABB8C5E079E09E2C8A8339C")
_HRR_BODY = b"\x02" + (38).to_bytes(3, "big") + b"\x03\x03" + HRR_RANDOM + b"\x00" * 4
HELLO_RETRY = b"\x16\x03\x03" + struct.pack("!H", len(_HRR_BODY)) + _HRR_BODY
ALERT_ACCESS_DENIED = b"\x15\x03\x03\x00\x02\x02\x31"


def recv_until_closed(sock: socket.socket) -> bytes:
    """Everything until the peer closes (a reset ends it too: the bytes read before it are kept)."""
    buf = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            buf += chunk
    return buf


def tunnel_outcome(gw, host: str) -> dict:
    """The tunnel's one outcome record (written when both sides are closed)."""

    def found() -> list[dict]:
        return [
            r
            for r in gw.audit_records()
            if r.get("egressgate.operation") == "outcome" and r.get("server.address") == host
        ]

    deadline = time.monotonic() + HANG_GUARD
    while not found():
        assert time.monotonic() < deadline, f"no outcome record for {host}; gateway log:\n{log_tail(gw)}"
        time.sleep(0.05)
    [record] = found()
    return record


@pytest.mark.parametrize("second", ["denied", "allowed"])
def test_a_second_client_hello_held_behind_a_fin_is_judged_after_a_hello_retry(gw, world, tunnels, second):
    """The tunnel was judged on the first ClientHello's SNI. A client pipelines a second ClientHello naming
    another host (`other.test`: no rule allows it) and half-closes, all before the server's hello (the gate
    holds that hello until the layer has handled the FIN); the server then asks for a retry (a TLS 1.3
    HelloRetryRequest: a server that acts on the next ClientHello's SNI). The held bytes are that second
    ClientHello: judged like the first, refused `host_mismatch` / `sni_mismatch` with an access_denied
    alert, and the upstream never sees them. Positive control: the same sequence with the second
    ClientHello naming the CONNECT host reaches the upstream after the retry, then the FIN, and the
    server's answers reach the client."""
    t = tunnels("fin-before-hello", f"hrr{second}")
    retry = client_hello(world, "other.test" if second == "denied" else t.host)
    t.client.sendall(t.hello + retry)
    t.client.shutdown(socket.SHUT_WR)
    up = t.accept()
    assert recv_exactly(up, len(t.hello)) == t.hello
    up.sendall(HELLO_RETRY)  # held in the gateway until its layer has handled the client's FIN
    if second == "denied":
        got = recv_until_closed(up)
        assert got == b"", (len(got), got[:16], log_tail(gw))  # nothing of the second ClientHello went up
        assert recv_until_closed(t.client) == HELLO_RETRY + ALERT_ACCESS_DENIED, log_tail(gw)
        out = tunnel_outcome(gw, t.host)
        assert (out["egressgate.decision"], out["egressgate.reason"], out["egressgate.detail"]) == (
            "deny",
            "host_mismatch",
            "sni_mismatch",
        ), out
        assert out["egressgate.tls.sni"] == "other.test"
        return
    assert recv_exactly(up, len(retry)) == retry, log_tail(gw)  # judged, then sent up after the retry
    up.sendall(SERVER_HELLO)
    assert recv_until_closed(up) == b"", log_tail(gw)  # then the client's FIN
    up.sendall(b"done")
    up.close()
    assert recv_until_closed(t.client) == HELLO_RETRY + SERVER_HELLO + b"done", log_tail(gw)
    out = tunnel_outcome(gw, t.host)
    assert (out["egressgate.decision"], out.get("egressgate.tls.sni")) == ("allow", t.host), out
