"""A stream waiting for its byte lease is paused, not cut and not read (gateway/pipeline/budgets.py hold_client).

The gateway runs through slow_lease_launcher.py: lease top-ups of sandboxes labelled `slow=lease` take
2 s (a store round trip near its timeout). mitmproxy keeps reading a connection whose layer waits for a
hook and queues what it reads, so without the hold a sandbox could make the gateway buffer everything it
sends meanwhile. Held, the socket stops being read and the kernel pushes back: the client cannot hand
over more than the sockets' buffers. Positive control: once the lease arrives the same upload completes,
intact, and nothing was cut.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.budgetworld import BudgetWorld, proxy_auth, read_status, start_gateways
from tests.support.launcher import LoopbackGateway, stop_gateway

LAUNCHER = [sys.executable, str(Path(__file__).with_name("slow_lease_launcher.py"))]
TOTAL = 48 * 1024 * 1024
WINDOW = 1.2  # seconds of sending while the 2 s top-up is in flight
HELD_MAX = 16 * 1024 * 1024  # socket buffers on loopback (send + receive autotuning) stay well below


@pytest.fixture(scope="module")
def gw(bw: BudgetWorld) -> Iterator[LoopbackGateway]:
    [gateway] = start_gateways(bw, bw.policy(10 * TOTAL, 1000), None, 1, launcher=LAUNCHER)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


def test_a_stream_waiting_for_its_lease_is_held_not_read(bw: BudgetWorld, gw: LoopbackGateway) -> None:
    data = gw.admit_sandbox({"policy": "exact", "labels": {"slow": "lease"}})
    auth = proxy_auth(data["id"], data["token"])
    port = bw.upstream.port
    mark = bw.upstream.mark()
    block = b"p" * 65536
    with socket.create_connection(gw.proxy, timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sock.sendall(f"POST http://up.test:{port}/c HTTP/1.1\r\nHost: up.test:{port}\r\n{auth}"
                     f"Transfer-Encoding: chunked\r\n\r\n{TOTAL:x}\r\n".encode())
        sent = 0
        sock.settimeout(0.05)
        deadline = time.monotonic() + WINDOW
        while time.monotonic() < deadline and sent < TOTAL:
            try:
                sent += sock.send(block[: min(len(block), TOTAL - sent)])
            except TimeoutError:
                continue
        held = sent
        assert held < HELD_MAX, f"the gateway kept reading while the lease was on its way: {held} bytes"
        sock.settimeout(30)
        while sent < TOTAL:  # positive control: the lease arrives and the stream resumes, nothing cut
            sent += sock.send(block[: min(len(block), TOTAL - sent)])
        sock.sendall(b"\r\n0\r\n\r\n")
        status, _ = read_status(sock)
    assert status == 200
    [got] = bw.upstream.since(mark)
    assert got.complete and got.body_len == TOTAL
