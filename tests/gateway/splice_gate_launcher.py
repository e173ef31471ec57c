"""The real `egressgate` CLI with a gate that forces one interleaving of a passthrough tunnel's take-over.

`python tests/gateway/splice_gate_launcher.py GATE_DIR run --config ...` runs the unmodified gateway, except
that passthrough tunnels to `<mode>-<n>.gate.test` go through a gate (tunnels to other hosts are untouched):
a chunk (or an EOF) that mitmproxy's reader task has read from a socket is held in that task, between
`read()` and `server_event`, exactly where a loaded event loop leaves it while the task waits for the
connection's lock, and the layer's take-over runs right then. Modes:

* `client-data` / `server-data`: the first chunk mitmproxy reads from the client / the upstream after the
  server's hello has been relayed. The take-over the layer scheduled is held until that chunk is in the
  task, then runs; GATE_DIR/<host> says `spliced` or `declined` (and GATE_DIR/<host>.spliced appears when
  a take-over succeeds, that one or a later one). A declined take-over releases the chunk at
  once; a splice releases it only after the splice has passed on that side's EOF, so any byte mitmproxy
  still held is written after the bytes and the FIN the test sends next (were it written at all).
* `client-eof`: the client's EOF, read and not yet handled, at the take-over (released right after it).
* `fin-before-hello`: the upstream's hello is held until the layer has handled the client's half-close
  (a client that sent its ClientHello, more bytes and a FIN before the server answered).

Every wait is on an event of the gateway's own, never on time. Used by test_splice_interleavings.py.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from mitmproxy import ctx
from mitmproxy.proxy import events

from egressgate.cli import main
from egressgate.gateway.tunnels import passthrough, splice

GATE_DIR = Path(sys.argv.pop(1)) if __name__ == "__main__" else Path(".")


def say(name: str, text: str) -> None:
    """Write GATE_DIR/<name> whole or not at all (a rename): the test polls for the name and reads it at once,
    so a file created and then written could be read empty."""
    tmp = GATE_DIR / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, GATE_DIR / name)


MODES = ("client-data", "server-data", "client-eof", "fin-before-hello")
_GATES: dict[asyncio.StreamReader, Gate] = {}


class Gate:
    """One gated tunnel: which socket's read is held, and what releases it."""

    def __init__(self, layer: passthrough.PassthroughLayer, mode: str, client, server) -> None:
        self.layer, self.mode, self.client, self.server = layer, mode, client, server
        self.captured = False
        self.deferred = False  # the layer asked for a take-over before the chunk was in hand
        self.attempted = False
        self.spliced = False
        self.release = asyncio.Event()
        self.client_closed = asyncio.Event()

    def in_relay(self) -> bool:
        return self.layer._handle_event == self.layer._relay and self.layer.splice is None

    async def on_read(self, reader: asyncio.StreamReader, data: bytes) -> None:
        if self.captured:
            return
        from_client = reader is self.client
        if self.mode == "fin-before-hello":
            if not from_client and data:
                self.captured = True
                await self.client_closed.wait()
            return
        wanted = {
            "client-data": from_client and bool(data),
            "server-data": not from_client and bool(data),
            "client-eof": from_client and not data,
        }[self.mode]
        if not (wanted and self.in_relay()):
            return
        self.captured = True
        asyncio.get_running_loop().call_soon(self.layer._take_over)  # now, with this chunk in the task
        await self.release.wait()

    def attempted_take_over(self) -> None:
        self.attempted = True
        outcome = "spliced" if self.layer.splice is not None else "declined"
        say(self.layer.conn.tunnel_host, outcome)
        if outcome == "declined":
            self.release.set()


def _gate(layer: passthrough.PassthroughLayer) -> Gate | None:
    return layer.__dict__.get("_test_gate")


_read = asyncio.StreamReader.read


async def _gated_read(self: asyncio.StreamReader, n: int = -1) -> bytes:
    data = await _read(self, n)
    gate = _GATES.get(self)
    if gate is not None:
        await gate.on_read(self, data)
    return data


_hello = passthrough.PassthroughLayer._hello


def _hello_installing_the_gate(self: passthrough.PassthroughLayer, event: events.Event):
    if "_test_gate" not in self.__dict__:
        self._test_gate = None
        host = self.conn.tunnel_host or ""
        mode = host.split(".")[0].rsplit("-", 1)[0]
        if host.endswith(".gate.test") and mode in MODES:
            handler = ctx.master.addons.get("proxyserver").connections[self.context.client.id]
            client, server = (handler.transports[c].reader for c in (self.context.client, self.context.server))
            self._test_gate = gate = Gate(self, mode, client, server)
            _GATES[client] = _GATES[server] = gate
    return (yield from _hello(self, event))


_await_server = passthrough.PassthroughLayer._await_server


def _await_server_noting_the_close(self: passthrough.PassthroughLayer, event: events.Event):
    yield from _await_server(self, event)
    gate = _gate(self)
    if gate is not None and isinstance(event, events.ConnectionClosed) and event.connection is self.context.client:
        gate.client_closed.set()


_take_over = passthrough.PassthroughLayer._take_over


def _gated_take_over(self: passthrough.PassthroughLayer) -> None:
    gate = _gate(self)
    if gate is not None and gate.mode != "fin-before-hello" and not gate.captured:
        # held until the chunk is in mitmproxy's task (Gate.on_read runs it then); the layer may ask again
        self.__dict__["take_over_due"] = False
        return
    _take_over(self)
    if gate is None:
        return
    if gate.captured and not gate.attempted and gate.mode != "fin-before-hello":
        gate.attempted_take_over()
    if self.splice is not None and not gate.spliced:
        gate.spliced = True
        say(f"{self.conn.tunnel_host}.spliced", "spliced")


_eof, _lost = splice.Splice.eof, splice.Splice.lost


def _release(spliced: splice.Splice) -> None:
    for gate in set(_GATES.values()):
        if gate.layer.splice is spliced:
            gate.release.set()  # the splice passed a FIN (or a reset) on: whatever mitmproxy held comes after


def _eof_releasing(self: splice.Splice, side) -> None:
    _eof(self, side)
    _release(self)


def _lost_releasing(self: splice.Splice, side, exc) -> None:
    _lost(self, side, exc)
    _release(self)


asyncio.StreamReader.read = _gated_read  # type: ignore[method-assign]
passthrough.PassthroughLayer._hello = _hello_installing_the_gate  # type: ignore[method-assign]
passthrough.PassthroughLayer._await_server = _await_server_noting_the_close  # type: ignore[method-assign]
passthrough.PassthroughLayer._take_over = _gated_take_over  # type: ignore[method-assign]
splice.Splice.eof = _eof_releasing  # type: ignore[method-assign]
splice.Splice.lost = _lost_releasing  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
