"""Streams of unknown total paid from leases (gateway/shared/ledger.py): a raw-TCP relay and a websocket each need
many lease top-ups before their budget is spent. While a top-up is in flight the stream waits (the
`tcp_message` / `websocket_wire` hook awaits it), so nothing is lost, reordered or cut while budget
remains; once the store says the budget is spent the stream is cut and the upstream never got more than
the budget. A lease granted is counted as spent while it is held; what the stream did not use is given
back when it ends (checked through the control API's usage)."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Iterator

import aiohttp
import httpx
import pytest
import yaml

from tests.support.gwworld import Gateway, connect_tunnel, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

BUDGET = 400_000


@pytest.fixture(scope="module")
def gw(world, tmp_path_factory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-leases")
    (tmp / "policies").mkdir()
    for name, network in (
        ("lease-tcp", {"tcp": {"allow": [{"id": "tcp-echo", "host": "tcp.test", "ports": [world.tcp_port]}]}}),
        ("lease-ws", {"https": {"allow": [{"id": "ws", "host": "api.test", "ports": [world.https_port],
                                          "methods": ["GET"], "paths": ["/ws"]}]}}),
    ):
        (tmp / "policies" / f"{name}.yaml").write_text(yaml.safe_dump({
            "sandbox": {"name": name, "resources": {"outbound_bytes_max": BUDGET}},
            "network": {"allow_private": ["127.0.0.1/32"], **network}}))
    gateway = start_gateway(world, tmp)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


def bytes_out(gw: Gateway, sandbox_id: str) -> int:
    res = httpx.get(f"http://{gw.admin}/v1/sandboxes/{sandbox_id}", headers={"Authorization": f"Bearer {gw.token}"},
                    timeout=10, trust_env=False)
    assert res.status_code == 200, res.text
    return int(res.json()["usage"]["bytes_out"])


def test_raw_tcp_relays_across_leases_and_is_cut_at_the_budget(gw: Gateway, world) -> None:
    sbx = gw.admit("lease-tcp")
    before = len(world.hits.tcp)
    sock, head = connect_tunnel(gw, sbx, f"tcp.test:{world.tcp_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    sock.settimeout(10)
    echoed = bytearray()
    reader = threading.Thread(target=lambda: _drain(sock, echoed), daemon=True)
    reader.start()
    piece = bytes(range(256)) * 32  # 8 KiB
    sent = b""
    for _ in range(36):  # 288 KiB: several leases, all within the budget
        sock.sendall(piece)
        sent += piece
    assert wait_for(lambda: echoed.count(b"echo:") and len(echoed) - 5 * echoed.count(b"echo:") >= len(sent),
                    timeout=10)
    assert bytes(echoed).replace(b"echo:", b"") == sent  # every byte, in order (positive control)
    try:  # past the budget: cut
        for _ in range(30):
            sock.sendall(b"x" * 8192)
    except OSError:
        pass
    reader.join(10)
    sock.close()
    assert wait_for(lambda: len(world.hits.tcp) > before)
    upstream = sum(len(d) for d in world.hits.tcp[before:])
    assert wait_for(lambda: outcome(gw, sbx.id) is not None, timeout=5)
    relayed = int(outcome(gw, sbx.id)["egressgate.bytes.out"])
    # never over; a reset may lose the last bytes on their way, never add any
    assert len(sent) < upstream <= relayed <= BUDGET
    assert relayed > BUDGET - 65536  # cut only at the read the budget could not hold (mitmproxy reads <= 64 KiB)
    # the store counts what was relayed: the unused rest of the last lease was given back
    assert wait_for(lambda: bytes_out(gw, sbx.id) == relayed, timeout=5), (bytes_out(gw, sbx.id), relayed)


def outcome(gw: Gateway, sandbox_id: str) -> dict | None:
    return next((r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox_id
                 and r.get("egressgate.operation") == "outcome"), None)


def _drain(sock, into: bytearray) -> None:
    try:
        while chunk := sock.recv(65536):
            into += chunk
    except OSError:
        pass


def test_websocket_frames_across_leases_then_cut(gw: Gateway, world) -> None:
    sbx = gw.admit("lease-ws")
    url = f"https://api.test:{world.https_port}/ws"
    ctx = ssl.create_default_context(cafile=gw.bundle)
    mark = world.hits.mark()
    size = 20_000

    async def run() -> tuple[int, bool]:
        echoed = 0
        auth = {"Proxy-Authorization": aiohttp.encode_basic_auth(sbx.id, sbx.token)}
        async with aiohttp.ClientSession() as session, session.ws_connect(
            url, proxy=f"http://{gw.proxy[0]}:{gw.proxy[1]}", proxy_headers=auth, ssl=ctx, max_msg_size=0,
        ) as ws:
            for _ in range(40):  # 800 kB offered, 400 kB budget
                try:
                    await ws.send_bytes(b"w" * size)
                    msg = await asyncio.wait_for(ws.receive(), 10)
                except (ConnectionError, TimeoutError, aiohttp.ClientError):
                    return echoed, True
                if msg.type != aiohttp.WSMsgType.TEXT:
                    return echoed, True
                assert msg.data == f"echo:{size}"
                echoed += 1
        return echoed, False

    box: list = []
    t = threading.Thread(target=lambda: box.append(asyncio.run(run())))
    t.start()
    t.join(60)
    echoed, closed = box[0]
    assert closed
    msgs = [h for h in world.hits.since(mark) if h["method"] == "WSMSG"]
    assert len(msgs) == echoed >= BUDGET // size - 2  # no cut while budget remained (upgrade head + framing)
    assert sum(h["len"] for h in msgs) <= BUDGET
    assert wait_for(lambda: bytes_out(gw, sbx.id) <= BUDGET, timeout=5)


def test_a_held_lease_is_not_reported_as_spent(gw: Gateway, world) -> None:
    """A relay that sent 8 bytes holds a lease of 4 KiB (counted as spent in the store, so no process can
    overbook); decisions, their records and the control API read what was sent: 8."""
    sbx = gw.admit("lease-tcp")
    sock, head = connect_tunnel(gw, sbx, f"tcp.test:{world.tcp_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    sock.settimeout(5)
    sock.sendall(b"\x00eight!!")
    assert sock.recv(100) == b"echo:\x00eight!!"
    try:
        second, head2 = connect_tunnel(gw, sbx, f"tcp.test:{world.tcp_port}")  # decided while the lease is held
        second.close()
        assert head2.startswith(b"HTTP/1.1 200")
        connects = [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sbx.id
                    and r.get("egressgate.operation") == "connect"]
        assert [int(r["egressgate.state.bytes_out"]) for r in connects] == [0, 8], connects
        assert bytes_out(gw, sbx.id) == 8
    finally:
        sock.close()
