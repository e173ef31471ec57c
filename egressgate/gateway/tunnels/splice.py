"""Relaying a checked passthrough tunnel outside mitmproxy's per-chunk event path.

mitmproxy moves every chunk of a connection through its handler: a StreamReader copy, the connection's
event lock and watchdog, the layer stack (proxy mode, HTTP layer, tunnel, our layer) and then a drain of
every writer. For a spliced tunnel none of that decides anything, and it made the passthrough route half
as fast as Squid's CONNECT tunnel for small keep-alive requests (loadtests/RESULTS.md, "Issue 11:
passthrough"). Once passthrough.py has checked the ClientHello and mitmproxy has handed the layer every
byte it read (both its reader tasks wait in `read()`: `_parked`), `Splice.take_over` swaps the asyncio
protocols of the tunnel's two sockets for a pair of `_Side` protocols that write each chunk straight to the
other socket, after counting it exactly as the layer does, from the same meter (ledger.py): a client chunk
the lease cannot cover stops reading from the client until the lease is topped up (one task per top-up,
not per chunk), one the budget cannot hold is never written and both sockets are aborted; server bytes
are counted in.

What stays mitmproxy's: the sockets (so revocation's and the budget's `abort_connection` reach them), the
idle timeout (each chunk registers activity with the connection's watchdog), and the end of the
connection: when both directions are done, each socket's original protocol is told the connection is
lost, so mitmproxy's tasks finish, its layers see the close and its hooks run as usual (the layer then
writes the one outcome record from the shared `Tally`). Flow control is the transports': a socket whose
write buffer passes the high-water mark pauses reading on the other one until it drains.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from mitmproxy import connection, ctx

from egressgate.gateway.shared.context import Runtime
from egressgate.gateway.shared.ledger import Meter
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Tally:
    """A tunnel's byte counts, shared by the layer (before the take-over) and the splice (after)."""

    out: int = 0
    in_: int = 0
    cut: bool = False
    cut_reason: str | None = None  # "state_unavailable" when the store failed, not the budget


def _parked(reader: asyncio.StreamReader) -> bool:
    """mitmproxy's reader task for this socket waits in `read()` for bytes that have not come yet.

    Only then has mitmproxy nothing of this socket in hand: its reader loop is `read()`, then
    `server_event(DataReceived)` (which waits for the handler's lock, a loop iteration or more when other
    events queue), then a drain of every writer, then `read()` again. A chunk it has read but not yet
    handed to the layers sits in that task, invisible in the StreamReader: taken over then, the chunk
    reached the layer after the splice had relayed newer bytes (out of order), or after the splice had
    passed the peer's FIN on, where mitmproxy's write raised and the chunk was lost (the upstream saw the
    ClientHello and a clean EOF). Bytes still in the StreamReader, an EOF or an error (which wake the
    task) are in hand too; taken from under it, its `read()` would return b"" and mitmproxy would act on
    an EOF the peer never sent. A pending `_waiter` rules out all of these: `feed_data`, `feed_eof` and
    `set_exception` complete and clear it, and the task sets it only with an empty buffer and no EOF."""
    waiter = reader._waiter  # no public API for this
    return waiter is not None and not waiter.done() and not reader._buffer and not reader._eof


class _Side(asyncio.Protocol):
    """One socket of the splice. `peer` is the other side; `old` the protocol mitmproxy had on it."""

    def __init__(self, splice: Splice, transport: asyncio.Transport, old: asyncio.BaseProtocol,
                 from_client: bool) -> None:
        self.splice, self.transport, self.old, self.from_client = splice, transport, old, from_client
        self.peer: _Side
        self.eof = False
        self.lost = False
        self.budget_wait = False  # reading paused: a chunk waits for a lease top-up
        self.backpressure = False  # reading paused: the peer's write buffer is full

    def data_received(self, data: bytes) -> None:
        self.splice.relay(self, data)

    def eof_received(self) -> bool:
        self.splice.eof(self)
        return True  # keep the socket open for the other direction (half close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.splice.lost(self, exc)

    def pause_writing(self) -> None:
        self.peer.backpressure = True
        self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        self.peer.backpressure = False
        self.peer.resume()

    def resume(self) -> None:
        """Read again unless something still holds this side (budget wait, backpressure, its end)."""
        if not (self.eof or self.lost or self.budget_wait or self.backpressure):
            self.transport.resume_reading()


class Splice:
    """The two sockets of one passthrough tunnel, relayed directly (see the module docstring)."""

    def __init__(self, rt: Runtime, sandbox_id: str, meter: Meter, tally: Tally) -> None:
        self.rt, self.sandbox_id, self.meter, self.tally = rt, sandbox_id, meter, tally
        self.top_up: asyncio.Task | None = None
        self.sides: tuple[_Side, _Side] | None = None
        self.activity: Callable[[], None] = lambda: None
        self.finished = False

    def take_over(self, client: connection.Client, server: connection.Server) -> bool | None:
        """Move both sockets to the splice; False (nothing changed) when they are not both open plain
        TCP sockets of a live mitmproxy connection whose ends it has not read, and the layer keeps relaying
        them itself; None (nothing changed) when mitmproxy may still hold something it read and did not
        hand to the layer (a reader task not parked in `read()`, see `_parked`): try again once it has."""
        proxyserver = ctx.master.addons.get("proxyserver") if ctx.master is not None else None
        handler = proxyserver.connections.get(client.id) if proxyserver is not None else None
        if handler is None or client.state is not connection.ConnectionState.OPEN \
                or server.state is not connection.ConnectionState.OPEN:
            return False
        ios = [handler.transports.get(client), handler.transports.get(server)]
        transports = [getattr(getattr(io, "writer", None), "transport", None) for io in ios]
        readers = [getattr(io, "reader", None) for io in ios]
        if not all(t is not None and hasattr(t, "set_protocol") and not t.is_closing()
                   and t.get_extra_info("sslcontext") is None for t in transports) \
                or not all(isinstance(r, asyncio.StreamReader) for r in readers):
            return False
        if any(r._eof or r.exception() is not None for r in readers):
            return False  # an end mitmproxy has seen or will see: the layer relays the rest
        if not all(_parked(r) for r in readers):
            return None
        c = _Side(self, transports[0], transports[0].get_protocol(), True)
        s = _Side(self, transports[1], transports[1].get_protocol(), False)
        c.peer, s.peer = s, c
        self.sides = (c, s)
        self.activity = handler.timeout_watchdog.register_activity
        for side in (c, s):
            side.transport.set_protocol(side)
        for side in (c, s):
            if not side.transport.is_reading() and not side.lost:
                side.transport.resume_reading()  # paused by the StreamReader's own limit
            if getattr(side.old, "_paused", False):
                side.old.resume_writing()  # release a drain mitmproxy may be waiting on (it writes no more)
        return True

    def relay(self, side: _Side, data: bytes) -> None:
        if side.lost or side.peer.lost or self.tally.cut:
            return
        self.activity()
        n = len(data)
        if side.from_client:
            if not self.meter.take(n):
                side.budget_wait = True
                side.transport.pause_reading()
                self.top_up = asyncio.get_running_loop().create_task(self._top_up(side, data))
                return
            self.tally.out += n
        else:
            self.tally.in_ += n
            self.rt.ledger.add_in(self.sandbox_id, n)
        side.peer.transport.write(data)

    async def _top_up(self, side: _Side, data: bytes) -> None:
        """The client's chunk waits (reading paused) for the lease; relayed if the store granted it."""
        try:
            ok = await self.meter.top_up(len(data))
        except StateUnavailable as exc:
            logger.error("byte budget of %s unavailable: %s; cutting a passthrough tunnel", self.sandbox_id, exc)
            self.meter.failed = "state_unavailable"
            ok = False
        side.budget_wait = False
        if side.lost or side.peer.lost or self.tally.cut:
            return  # whatever the top-up brought goes back when the layer closes the meter
        if not (ok and self.meter.take(len(data))):
            self.cut()
            return
        self.tally.out += len(data)
        self.activity()
        side.peer.transport.write(data)
        side.resume()

    def cut(self) -> None:
        self.tally.cut = True
        self.tally.cut_reason = self.meter.failed
        logger.info("sandbox %s: %s in a passthrough tunnel; cutting", self.sandbox_id,
                    self.meter.failed or "outbound_bytes_max crossed")
        for each in self.sides or ():
            each.transport.abort()

    def eof(self, side: _Side) -> None:
        side.eof = True
        side.transport.pause_reading()
        peer = side.peer
        if peer.lost:
            return
        if peer.eof:  # both directions done: a clean close of both
            side.transport.close()
            peer.transport.close()
        elif peer.transport.can_write_eof():
            peer.transport.write_eof()

    def lost(self, side: _Side, exc: Exception | None) -> None:
        side.lost = True
        peer = side.peer
        if not peer.lost:
            if exc is None and side.eof and peer.eof:
                peer.transport.close()
            else:  # one socket died (reset, abort: revocation, budget): the other must not look finished
                peer.transport.abort()
            return
        self._finish()

    def _finish(self) -> None:
        """Both sockets are gone: hand the end back to mitmproxy (its readers see EOF, its layers the
        close, its hooks run), once."""
        if self.finished or self.sides is None:
            return
        self.finished = True
        for side in self.sides:
            try:
                side.old.connection_lost(None)
            except Exception:
                logger.exception("handing a spliced connection's end back to mitmproxy failed")
