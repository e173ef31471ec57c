"""WebSocket control frames get the credential checks (issue 9, items 2 and 3): an upstream that echoes
the injected credential in a Ping, a Pong or a Close reason must not hand it to the sandbox, and a
phantom placeholder in a Ping, Pong or Close reason from the sandbox is misuse (not relayed, closed,
audited). Real gateway, real OpenBao, the reflecting upstream `/wsctl` (conftest), a raw wsproto client.
"""

from __future__ import annotations

import base64
import secrets
import time

import pytest

from tests.support.bao import KV_SECRET
from tests.support.credworld import Gateway
from tests.support.wsclient import CloseConnection, Ping, Pong, TextMessage, WsClient, open_tunnel

B64_SECRET = base64.b64encode(KV_SECRET.encode()).decode()


def ws_open(gw: Gateway, sbx: dict, host: str, port: int, headers: list | None = None) -> WsClient:
    sock = open_tunnel(gw.proxy, sbx["id"], sbx["token"], f"{host}:{port}", gw.bundle, host)
    return WsClient(sock, f"{host}:{port}", "/wsctl", headers)


def reflected(ws: WsClient, command: str) -> bytes:
    """Ask /wsctl to send one control frame; return its payload (a Close: its reason) as received."""
    assert ws.send(TextMessage(command))
    kind = {"ping": Ping, "pong": Pong, "close": CloseConnection}[command]
    evs = ws.receive(5, until=lambda e: isinstance(e, kind))
    frames = [e for e in evs if isinstance(e, kind)]
    assert frames, f"no {command} came back: {evs}"
    return frames[0].reason.encode() if command == "close" else bytes(frames[0].payload)


@pytest.mark.parametrize("command", ["ping", "pong", "close"])
def test_credential_echoed_in_control_frame_is_scrubbed(cgw: Gateway, command: str) -> None:
    sbx = cgw.admit("cred-kv")
    mark = cgw.world.hits.mark()
    ws = ws_open(cgw, sbx, "other.test", cgw.world.https2_port)  # rule `ws`: credential kv injected
    try:
        got = reflected(ws, command)
    finally:
        ws.close()
    opened = [h for h in cgw.world.hits.since(mark) if h["method"] == "GET" and h["path"] == "/wsctl"]
    assert [h["auth"] for h in opened] == [[f"Bearer {KV_SECRET}"]]  # the upstream did hold it
    assert KV_SECRET.encode() not in got and B64_SECRET.encode() not in got, got
    assert got == b"auth=[REDACTED] b64=[REDACTED]"
    if command == "close":
        assert ws.closed is not None and ws.closed.code == 4000  # the code is relayed as sent


@pytest.mark.parametrize("command", ["ping", "pong", "close"])
def test_control_frame_echo_visible_without_credential(cgw: Gateway, command: str) -> None:
    """Positive control: on a route without a credential (`api-port2`, same upstream) the echo of the
    sandbox's own Authorization header comes back untouched — the reflection is real."""
    sbx = cgw.admit("cred-kv")
    mine = "mine-" + secrets.token_hex(8)
    ws = ws_open(cgw, sbx, "api.test", cgw.world.https2_port, [("Authorization", f"Bearer {mine}")])
    try:
        got = reflected(ws, command)
    finally:
        ws.close()
    assert got == f"auth={mine} b64={base64.b64encode(mine.encode()).decode()}".encode()


def misuse_records(gw: Gateway, sandbox_id: str) -> list[dict]:
    return [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox_id
            and r.get("egressgate.reason") == "credential_misuse"]


@pytest.mark.parametrize("kind", ["ping", "pong", "close"])
def test_phantom_in_control_frame_is_misuse(cgw: Gateway, kind: str) -> None:
    sbx = cgw.admit("cred-phantom")
    phantom = sbx["env"]["OPENAI_API_KEY"]
    mark = cgw.world.hits.mark()
    ws = ws_open(cgw, sbx, "other.test", cgw.world.https_port)  # rule `other`: no credential
    try:
        # positive control: an ordinary ping reaches the upstream and is answered
        assert ws.send(Ping(b"hello"))
        assert [bytes(e.payload) for e in ws.receive(5, until=lambda e: isinstance(e, Pong))
                if isinstance(e, Pong)] == [b"hello"]
        carrier = f"key {phantom}"
        event = {"ping": Ping(carrier.encode()), "pong": Pong(carrier.encode()),
                 "close": CloseConnection(1000, carrier)}[kind]
        assert ws.send(event)
        ws.receive(5, until=lambda e: isinstance(e, CloseConnection))
    finally:
        ws.close()
    assert ws.closed is not None and ws.closed.code == 1008 and "credential_misuse" in ws.closed.reason
    seen = [h for h in cgw.world.hits.since(mark) if h["method"] == "WSCTL"]
    assert [h["body"] for h in seen if h["query"] == "ping"] == [b"hello"]
    assert all(phantom.encode() not in h["body"] for h in seen), seen  # never relayed
    time.sleep(0.3)
    recs = misuse_records(cgw, sbx["id"])
    assert recs and recs[0].get("egressgate.detail") == f"websocket_{kind}"
    assert phantom not in cgw.audit_text()
