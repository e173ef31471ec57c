"""GuardedWebsocketLayer driven sans-io (mitmproxy's own event/command interface, real wsproto frames):
the fragment buffer never exceeds the limit and is released on close, a crashing addon (FailClosed)
closes the websocket instead of being ignored, and control payloads never reach the log. The
end-to-end behaviour (budgets, phantoms, scrubbing) is tested through the real gateway in
test_websocket_frames.py and tests/gateway_credentials/test_websocket_control.py."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest
import wsproto.frame_protocol as fp
from mitmproxy import exceptions, options
from mitmproxy.connection import Client
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import websocket as mitm_ws
from mitmproxy.test import tflow
from wsproto.extensions import PerMessageDeflate

from egressgate.gateway.failclosed import FailClosed
from egressgate.gateway.layers import ws_layer

LIMIT = 4096


class Broken:
    def websocket_control(self, frame):
        raise RuntimeError("bug in the scrubber")


def make_layer(deflate: bool = False) -> tuple[ws_layer.GuardedWebsocketLayer, Context]:
    flow = tflow.twebsocketflow(messages=False)
    if deflate:
        flow.response.headers["Sec-WebSocket-Extensions"] = "permessage-deflate"
    context = Context(flow.client_conn, options.Options())
    context.server = flow.server_conn
    layer = ws_layer.GuardedWebsocketLayer(context, flow)
    layer.max_message_bytes = LIMIT
    return layer, context


def drive(layer, event: events.Event, on_hook: Callable[[commands.StartHook], None] = lambda h: None) -> list:
    """Feed one event; answer every hook (after `on_hook` acted on it) like mitmproxy's server would."""
    out: list = []
    queue = [event]
    while queue:
        for cmd in layer.handle_event(queue.pop(0)):
            out.append(cmd)
            if isinstance(cmd, commands.StartHook):
                on_hook(cmd)
                queue.append(events.HookCompleted(cmd))
    return out


def client_frames() -> fp.FrameProtocol:
    return fp.FrameProtocol(client=True, extensions=[])  # masked, as a client sends them


def close_codes(out: list, conn) -> list[int]:
    """Close codes in the frames sent to `conn` (frames to the client are unmasked, to the server masked)."""
    decoder = fp.FrameProtocol(client=isinstance(conn, Client), extensions=[])
    for cmd in out:
        if isinstance(cmd, commands.SendData) and cmd.connection is conn:
            decoder.receive_bytes(cmd.data)
    return [int(f.payload[0]) for f in decoder.received_frames() if f.opcode is fp.Opcode.CLOSE]


def closed(out: list) -> list:
    return [c.connection for c in out if isinstance(c, commands.CloseConnection)]


def test_fragment_buffer_bounded_and_released() -> None:
    layer, ctx = make_layer()
    drive(layer, events.Start())
    proto = client_frames()
    for i in range(4):
        out = drive(layer, events.DataReceived(ctx.client, bytes(proto.send_data(b"x" * 1000, fin=False))))
        assert layer._buffers[True].size == 1000 * (i + 1)
        assert not any(isinstance(c, commands.SendData) for c in out)  # nothing relayed before FIN
    out = drive(layer, events.DataReceived(ctx.client, bytes(proto.send_data(b"x" * 1000, fin=False))))
    assert layer._buffers[True].size == 0 and layer._buffers[False].size == 0  # released
    assert close_codes(out, ctx.client) == [1009] and close_codes(out, ctx.server) == [1009]
    assert any(isinstance(c, mitm_ws.WebsocketEndHook) for c in out)
    assert layer.flow.websocket.close_code == 1009 and not layer.flow.live
    assert ws_layer.refusal_of(layer.flow).reason == "message_too_large"
    # lingering close: the server is closed now; the sandbox's connection stays until its Close, so a
    # sandbox still sending cannot get a reset that destroys our Close before it reads it
    assert closed(out) == [ctx.server]
    assert drive(layer, events.DataReceived(ctx.client, bytes(proto.send_data(b"y" * 3000)))) == []  # discarded
    assert layer._buffers[True].size == 0
    out = drive(layer, events.DataReceived(ctx.client, bytes(proto.close(1009))))
    assert closed(out) == [ctx.client] and not any(isinstance(c, commands.SendData) for c in out)


def test_lingering_close_is_bounded() -> None:
    """A sandbox that never sends its Close is closed after LINGER_SECONDS or LINGER_MAX_BYTES."""
    for by_time in (True, False):
        layer, ctx = make_layer()
        drive(layer, events.Start())
        proto = client_frames()
        out = drive(layer, events.DataReceived(ctx.client, bytes(proto.send_data(b"x" * (LIMIT + 1), fin=False))))
        wakeups = [c for c in out if isinstance(c, commands.RequestWakeup)]
        assert [w.delay for w in wakeups] == [ws_layer.LINGER_SECONDS] and closed(out) == [ctx.server]
        if by_time:
            out = drive(layer, events.Wakeup(wakeups[0]))
        else:
            junk = bytes(proto.send_data(b"j" * 60_000, fin=False))
            out = []
            for _ in range(ws_layer.LINGER_MAX_BYTES // len(junk) + 1):
                out += drive(layer, events.DataReceived(ctx.client, junk))
            assert drive(layer, events.Wakeup(wakeups[0])) == []  # the late wakeup is harmless
        assert closed(out) == [ctx.client]


def test_message_at_the_limit_is_relayed_with_its_framing() -> None:
    layer, ctx = make_layer()
    drive(layer, events.Start())
    proto = client_frames()
    wire = b"".join(bytes(proto.send_data(b"z" * 1024, fin=i == 3)) for i in range(4))
    out = drive(layer, events.DataReceived(ctx.client, wire))
    server = fp.FrameProtocol(client=False, extensions=[])
    for cmd in out:
        if isinstance(cmd, commands.SendData) and cmd.connection is ctx.server:
            server.receive_bytes(cmd.data)
    frames = list(server.received_frames())
    assert [len(f.payload) for f in frames] == [1024] * 4 and frames[-1].message_finished
    assert layer._buffers[True].size == 0


@pytest.mark.parametrize("frame", ["ping", "close"])
def test_crashing_addon_closes_the_websocket(frame: str) -> None:
    """FailClosed kills the flow on an addon exception; mitmproxy's own layer ignores a kill on a live
    websocket, the guarded one closes both sides with 1011 and relays nothing."""
    layer, ctx = make_layer()
    drive(layer, events.Start())
    addon = FailClosed(Broken(), lambda client_id: None)

    def on_hook(hook: commands.StartHook) -> None:
        if isinstance(hook, ws_layer.WebsocketControlHook):
            with pytest.raises(exceptions.AddonHalt):  # FailClosed halts the chain after killing the flow
                addon.websocket_control(hook.frame)

    proto = client_frames()
    data = proto.ping(b"hi") if frame == "ping" else proto.close(1000, "bye")
    out = drive(layer, events.DataReceived(ctx.client, bytes(data)), on_hook)
    assert close_codes(out, ctx.client) == [1011] and close_codes(out, ctx.server) == [1011]
    assert ws_layer.refusal_of(layer.flow).reason == "internal_error"


def test_control_payloads_are_not_logged() -> None:
    layer, ctx = make_layer()
    drive(layer, events.Start())
    secret = b"sk-live-do-not-log"
    server = fp.FrameProtocol(client=False, extensions=[])
    out = drive(layer, events.DataReceived(ctx.server, bytes(server.ping(secret))))
    out += drive(layer, events.DataReceived(ctx.server, bytes(server.pong(secret))))
    logs = [c.message for c in out if isinstance(c, commands.Log)]
    assert logs and all("sk-live" not in m for m in logs)
    relayed = fp.FrameProtocol(client=True, extensions=[])
    for cmd in out:
        if isinstance(cmd, commands.SendData) and cmd.connection is ctx.client:
            relayed.receive_bytes(cmd.data)
    assert [bytes(f.payload) for f in relayed.received_frames()] == [secret, secret]  # relayed (no credential)


def test_compressed_bomb_is_not_inflated_past_the_limit() -> None:
    """permessage-deflate: 16 MiB of zeros compress to ~16 KiB in one frame. The gateway must refuse it
    (1009) without inflating it: wsproto alone would build the whole 16 MiB in one call."""
    layer, ctx = make_layer(deflate=True)
    drive(layer, events.Start())
    ext = PerMessageDeflate()
    ext.finalize("permessage-deflate")
    proto = fp.FrameProtocol(client=True, extensions=[ext])
    wire = bytes(proto.send_data(b"\0" * (16 * 1024 * 1024), fin=True))
    assert len(wire) < 64 * 1024  # one mitmproxy read
    tracemalloc.start()
    try:
        out = drive(layer, events.DataReceived(ctx.client, wire))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert close_codes(out, ctx.client) == [1009] and close_codes(out, ctx.server) == [1009]
    assert ws_layer.refusal_of(layer.flow).reason == "message_too_large"
    assert peak < 1024 * 1024, f"inflated {peak} bytes for a {LIMIT}-byte limit"
    assert not any(isinstance(c, commands.SendData) and c.connection is ctx.server and len(c.data) > 64
                   for c in out)  # only the Close went upstream


def test_compressed_message_under_the_limit_is_relayed() -> None:
    """Positive control: a compressed 3,000-byte message passes and reaches the server."""
    layer, ctx = make_layer(deflate=True)
    drive(layer, events.Start())
    ext = PerMessageDeflate()
    ext.finalize("permessage-deflate")
    out = drive(layer, events.DataReceived(ctx.client, bytes(fp.FrameProtocol(client=True, extensions=[ext])
                                                             .send_data(b"a" * 3000, fin=True))))
    server_ext = PerMessageDeflate()
    server_ext.finalize("permessage-deflate")
    server = fp.FrameProtocol(client=False, extensions=[server_ext])
    for cmd in out:
        if isinstance(cmd, commands.SendData) and cmd.connection is ctx.server:
            server.receive_bytes(cmd.data)
    assert b"".join(f.payload for f in server.received_frames()) == b"a" * 3000
