"""Every byte of every WebSocket frame meets the budget, and a fragmented message is bounded (issue 9,
items 3 and 5). A raw wsproto client (tests/support/wsclient.py) sends the frames an attacker would;
the upstream is the world's aiohttp websocket (`/ws`: answers pings, echoes `echo:<len>` per message).

Own gateway: `websocket.max_message_bytes` = 1 MiB, plus a policy with a 20 kB budget (the issue's
numbers: 1,000 pings of 125 bytes = 131 kB on the wire passed a 20 kB budget).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import yaml

from tests.support.gwworld import Gateway, Sandbox, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for
from tests.support.wsclient import BytesMessage, CloseConnection, Ping, Pong, TextMessage, WsClient, open_tunnel

MAX_MESSAGE = 1024 * 1024
BUDGET_20K = 20_000
CHUNK = 64 * 1024


@pytest.fixture(scope="module")
def wsgw(world, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("wsgw")
    (tmp / "policies").mkdir()
    rule = {"id": "ws", "host": "api.test", "ports": [world.https_port], "methods": ["GET"], "paths": ["/ws"]}
    doc = {"sandbox": {"name": "ws-20k", "resources": {"outbound_bytes_max": BUDGET_20K}},
           "network": {"allow_private": ["127.0.0.1/32"], "https": {"allow": [rule]}}}
    (tmp / "policies" / "ws-20k.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    gw = start_gateway(world, tmp, {"websocket": {"max_message_bytes": MAX_MESSAGE}})
    try:
        yield gw
    finally:
        stop_gateway(gw)


def ws_open(gw: Gateway, sbx: Sandbox) -> WsClient:
    port = gw.world.https_port
    sock = open_tunnel(gw.proxy, sbx.id, sbx.token, f"api.test:{port}", gw.bundle, "api.test")
    return WsClient(sock, f"api.test:{port}", "/ws")


def session_record(gw: Gateway, sbx: Sandbox) -> dict | None:
    """The websocket's session outcome (written when it ends), if any."""
    recs = [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sbx.id
            and r.get("egressgate.operation") == "outcome" and "egressgate.websocket.closed_by" in r]
    return recs[-1] if recs else None


def ws_hits(gw: Gateway, mark: int) -> list[dict]:
    return [h for h in gw.world.hits.since(mark) if h["method"] == "WSMSG"]


def send_fragments(ws: WsClient, total: int, size: int, fin_at_end: bool = False) -> int:
    """Send `total` bytes as continuation frames of `size` (no FIN unless `fin_at_end`). After each
    fragment an empty Ping is a barrier: its Pong proves the gateway processed the fragment, a Close
    means it refused it — so nothing is in flight when the gateway closes. Returns bytes sent."""
    sent, seen = 0, []
    while sent < total:
        n = min(size, total - sent)
        last = fin_at_end and sent + n >= total
        if not ws.send(BytesMessage(b"f" * n, message_finished=last)):
            break
        sent += n
        if not ws.send(Ping(b"")):
            break
        seen += ws.receive(10, until=lambda e: isinstance(e, Pong | CloseConnection))
        if ws.closed is not None or ws.gone:
            break
    ws.pending = [e for e in seen if not isinstance(e, Pong)] + ws.pending  # keep what arrived (an echo)
    return sent


# ------------------------------------------------------------------------------------ control frames
def test_pings_pass_without_budget(wsgw: Gateway) -> None:
    """Positive control: 1,000 pings of 125 bytes through the gateway reach the upstream, which
    answers each (so the cut below is the budget, not a broken relay)."""
    sbx = wsgw.admit("gw-basic")
    ws = ws_open(wsgw, sbx)
    try:
        for i in range(1000):
            assert ws.send(Ping(b"%04d" % i + b"p" * 121))
        pongs: list = []
        deadline = time.monotonic() + 20
        while len(pongs) < 1000 and time.monotonic() < deadline and ws.closed is None:
            pongs += [e for e in ws.receive(1.0) if isinstance(e, Pong)]
        assert len(pongs) == 1000 and ws.closed is None
        assert bytes(pongs[999].payload) == b"0999" + b"p" * 121
    finally:
        ws.close()


def test_pings_counted_and_cut_at_budget(wsgw: Gateway) -> None:
    """1,000 pings (131 bytes each on the wire) against a 20 kB budget: the ping that would cross it
    is not relayed, the sandbox gets Close 1008 `budget_exceeded`, and the cut is audited."""
    sbx = wsgw.admit("ws-20k")
    ws = ws_open(wsgw, sbx)
    answered = 0
    try:
        for i in range(1000):
            if not ws.send(Ping(b"%04d" % i + b"p" * 121)):
                break
            evs = ws.receive(5, until=lambda e: isinstance(e, Pong | CloseConnection))
            answered += sum(isinstance(e, Pong) for e in evs)
            if ws.closed is not None or ws.gone:
                break
    finally:
        ws.close()
    assert ws.closed is not None, "1,000 pings passed a 20 kB budget"
    assert ws.closed.code == 1008 and "budget_exceeded" in ws.closed.reason
    assert 100 < answered < 155  # ~(20000 - upgrade head) / 131: every relayed ping was paid for
    assert wait_for(lambda: session_record(wsgw, sbx) is not None)
    rec = session_record(wsgw, sbx)
    assert rec["egressgate.reason"] == "budget_exceeded" and rec["egressgate.decision"] == "deny"
    assert rec["egressgate.budget_cut"] is True and rec["egressgate.websocket.closed_by"] == "gateway"
    assert answered * 131 <= int(rec["egressgate.bytes.out"]) < BUDGET_20K


# ------------------------------------------------------------------------------------ fragments
def test_fragments_below_the_limit_are_relayed(wsgw: Gateway) -> None:
    """Positive control: a 900 KiB message in 64 KiB fragments (with FIN) reaches the upstream whole."""
    sbx = wsgw.admit("gw-basic")
    mark = wsgw.world.hits.mark()
    ws = ws_open(wsgw, sbx)
    try:
        send_fragments(ws, 900 * 1024, CHUNK, fin_at_end=True)
        evs = ws.receive(10, until=lambda e: isinstance(e, TextMessage))
    finally:
        ws.close()
    assert [e.data for e in evs if isinstance(e, TextMessage)] == [f"echo:{900 * 1024}"]
    assert [h["len"] for h in ws_hits(wsgw, mark)] == [900 * 1024]


def test_fragments_without_fin_closed_at_message_limit(wsgw: Gateway) -> None:
    """4 MiB of continuation frames without FIN against a 1 MiB limit: the gateway closes with 1009
    `message_too_large` at the fragment that passes 1 MiB (it stopped reading there: the audited bytes
    stay within one read of the limit), the upstream never gets any of it, and it is audited."""
    sbx = wsgw.admit("gw-basic")
    mark = wsgw.world.hits.mark()
    ws = ws_open(wsgw, sbx)
    try:
        sent = send_fragments(ws, 4 * MAX_MESSAGE, CHUNK)
        ws.receive(2, until=lambda e: isinstance(e, CloseConnection))
    finally:
        ws.close()
    assert ws.closed is not None, f"{sent} bytes without FIN were buffered, no limit applied"
    assert ws.closed.code == 1009 and "message_too_large" in ws.closed.reason
    assert sent <= MAX_MESSAGE + 2 * CHUNK
    assert ws_hits(wsgw, mark) == []
    assert wait_for(lambda: session_record(wsgw, sbx) is not None)
    rec = session_record(wsgw, sbx)
    assert rec["egressgate.reason"] == "message_too_large" and rec["egressgate.detail"] == "from_client"
    assert int(rec["egressgate.bytes.out"]) <= MAX_MESSAGE + CHUNK + 4096


def test_fragments_counted_against_budget_as_they_arrive(gateway: Gateway) -> None:
    """Budget per fragment, not per message: 1,000-byte continuation frames without FIN against the
    4,000-byte budget are cut after a few fragments (1008 budget_exceeded), long before any FIN."""
    sbx = gateway.admit("gw-budget")
    mark = gateway.world.hits.mark()
    ws = ws_open(gateway, sbx)
    try:
        sent = send_fragments(ws, 50_000, 1000)
        ws.receive(2, until=lambda e: isinstance(e, CloseConnection))
    finally:
        ws.close()
    assert ws.closed is not None, f"{sent} bytes of fragments passed a 4,000-byte budget"
    assert ws.closed.code == 1008 and "budget_exceeded" in ws.closed.reason
    assert sent <= 4000
    assert ws_hits(gateway, mark) == []
    assert wait_for(lambda: session_record(gateway, sbx) is not None)
    assert session_record(gateway, sbx)["egressgate.reason"] == "budget_exceeded"


def test_fragmented_message_under_budget_relayed(gateway: Gateway) -> None:
    """Positive control for the budget: a 2,000-byte message in two fragments fits and is relayed."""
    sbx = gateway.admit("gw-budget")
    mark = gateway.world.hits.mark()
    ws = ws_open(gateway, sbx)
    try:
        send_fragments(ws, 2000, 1000, fin_at_end=True)
        evs = ws.receive(5, until=lambda e: isinstance(e, TextMessage))
    finally:
        ws.close()
    assert [e.data for e in evs if isinstance(e, TextMessage)] == ["echo:2000"]
    assert [h["len"] for h in ws_hits(gateway, mark)] == [2000]
