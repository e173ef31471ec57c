"""A minimal multiplexed Redis connection for the state store's hot path.

Why not redis-py for these commands: its per-command cost (pool checkout, per-reply parsing in
Python, a read per reply) measured ~100-130 us of CPU per command here, ~240 us inside a busy gateway:
at four state operations per request that was a third of a request's CPU. This one writes every
command to one socket and matches the replies in order (Redis answers a connection in order), so
concurrent requests pipeline by themselves and a command costs ~20 us. redis-py stays in use for
everything else (pub/sub, admission's MULTI, heartbeats, other modules' keys).

Safety rules of a multiplexed connection, each enforced here:
- A reply is given to the oldest waiter; a waiter whose caller was cancelled still consumes its
  reply (the queue never shifts), its result is dropped.
- A reply that does not come within `timeout` poisons the ordering: the connection is closed and
  every waiter fails (ConnectionError); nothing is read from it again. The next command reconnects.
  That timeout, and the connect's, count only time in which the event loop could run (state/stall.py):
  a loop stalled past them is not taken for a slow Redis.
- The connection going away fails every waiter. Whether those commands ran is unknown: callers treat
  it as a failure (state_unavailable) and never resend a write.

Packing and reply parsing use hiredis's C code when it is installed (a dependency of egressgate: redis-py
uses it too), the pure-Python `pack`/`parse` below otherwise; both give the same bytes and values
(tests/state_redis/test_resp.py). Measured: ~5x less CPU to pack a `reserve_request`, ~10x to parse a reply.
A command is written at once when none is in flight (one request at a time: no loop turn waits for the
write); while replies are awaited, the commands of one loop tick still leave in one write.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import Any

from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from egressgate.state.stall import STEPS, LoopClock, overdue
from egressgate.state.stall import timeout as loop_timeout

try:
    import hiredis
except ImportError:  # the pure-Python code below serves
    hiredis = None

_INCOMPLETE = object()


def pack(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def parse(buf: bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2 reply at `pos` → (value, next position), or (_INCOMPLETE, pos). Errors are returned as
    exception objects (the waiter's future raises them)."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return _INCOMPLETE, pos
    kind = buf[pos]
    line = bytes(buf[pos + 1:end])
    nxt = end + 2
    if kind == 0x2B:  # +
        return line.decode(), nxt
    if kind == 0x2D:  # -
        text = line.decode(errors="replace")
        return (NoScriptError if text.startswith("NOSCRIPT") else ResponseError)(text), nxt
    if kind == 0x3A:  # :
        return int(line), nxt
    if kind == 0x24:  # $
        size = int(line)
        if size < 0:
            return None, nxt
        if len(buf) < nxt + size + 2:
            return _INCOMPLETE, pos
        return bytes(buf[nxt:nxt + size]).decode(), nxt + size + 2
    if kind == 0x2A:  # *
        count = int(line)
        if count < 0:
            return None, nxt
        items = []
        for _ in range(count):
            item, nxt = parse(buf, nxt)
            if item is _INCOMPLETE:
                return _INCOMPLETE, pos
            items.append(item)
        return items, nxt
    raise ValueError(f"unexpected RESP type byte {kind!r}")


def fast_pack(args: tuple[Any, ...]) -> bytes:
    """`pack`, in C when hiredis is there (it takes str, int, float and bytes: anything else, e.g. a bool,
    goes the Python way, which writes its str())."""
    try:
        return hiredis.pack_command(args)
    except TypeError:
        return pack(args)


class _PyReader:
    """The pure-Python reader: `feed` bytes, `gets` one reply or _INCOMPLETE; ValueError when unreadable."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pos = 0

    def feed(self, data: bytes) -> None:
        if self.pos:
            del self.buf[:self.pos]
            self.pos = 0
        self.buf += data

    def gets(self) -> Any:
        try:
            value, self.pos = parse(self.buf, self.pos)
        except IndexError as exc:
            raise ValueError(str(exc)) from exc
        return value


class _CReader:
    """hiredis's reader with the same answers as `parse`: errors as NoScriptError/ResponseError objects."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(encoding="utf-8", replyError=ResponseError)
        self.feed = self._reader.feed

    def gets(self) -> Any:
        try:
            value = self._reader.gets()
        except hiredis.ProtocolError as exc:
            raise ValueError(str(exc)) from exc
        if value is False:  # "not enough data": RESP2 has no boolean replies, so False means only that
            return _INCOMPLETE
        if type(value) is ResponseError and str(value).startswith("NOSCRIPT"):
            return NoScriptError(str(value))
        return value


_pack = pack if hiredis is None else fast_pack
_Reader = _PyReader if hiredis is None else _CReader


class _Protocol(asyncio.Protocol):
    def __init__(self, clock: LoopClock) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = _Reader()
        self.clock = clock  # the connection's watchdog observes it; a waiter is stamped with (live, wall)
        self.waiters: deque[tuple[asyncio.Future, float, float]] = deque()
        self.closed = False
        self._out: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, data: bytes) -> asyncio.Future:
        if self.closed or self.transport is None:
            raise RedisConnectionError("connection to Redis is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        idle = not self.waiters
        clock = self.clock
        self.waiters.append((future, clock.now(), clock.wall))
        if idle:  # nothing in flight, nothing queued: no reason to wait for the end of the tick
            self.transport.write(data)
            return future
        if not self._out:  # the commands of one loop tick go out in one write
            loop.call_soon(self._flush)
        self._out.append(data)
        return future

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.closed and self.transport is not None:
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        try:
            reader.feed(data)
            while self.waiters:
                value = reader.gets()
                if value is _INCOMPLETE:
                    break
                future = self.waiters.popleft()[0]
                if not future.done():
                    if isinstance(value, Exception):
                        future.set_exception(value)
                    else:
                        future.set_result(value)
        except ValueError as exc:  # UnicodeDecodeError included
            self.abort(RedisConnectionError(f"unreadable reply from Redis ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.abort(RedisConnectionError(f"connection to Redis lost ({exc or 'closed by server'})"))

    def abort(self, error: Exception) -> None:
        self.closed = True
        while self.waiters:
            future = self.waiters.popleft()[0]
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.abort()


class RespConnection:
    """Connects lazily, reconnects on the next command after any failure."""

    def __init__(self, url: str, *, timeout: float, connect_timeout: float) -> None:
        self.kwargs = parse_url(url)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        # observed every step by the watchdog (connected) or by the connect's deadline, and by each command;
        # `clock.stalls` counts the stalls it saw
        self.clock = LoopClock(timeout / STEPS)
        self._failed_at = -1.0  # monotonic time of the last failed connect, and why
        self._failure: Exception | None = None

    async def call(self, *args: Any) -> Any:
        proto = self._proto
        if proto is None or proto.closed:
            proto = await self._connect()
        return await proto.send(_pack(args))

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with self._connecting:
            if self._proto is not None and not self._proto.closed:
                return self._proto
            if self._failed_at >= started and self._failure is not None:
                # an attempt made while we waited has just failed: share its answer rather than queue
                # one connect timeout per waiting caller behind each other
                raise RedisConnectionError(str(self._failure))
            try:
                return await self._open()
            except BaseException as exc:
                self._failed_at, self._failure = loop.time(), exc
                raise

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        kw = self.kwargs
        clock = self.clock
        clock.resume()  # unobserved while disconnected: nothing waited on it
        try:
            async with loop_timeout(self.connect_timeout, "no connection", clock):
                if "path" in kw:
                    _, proto = await loop.create_unix_connection(lambda: _Protocol(clock), kw["path"])
                else:
                    _, proto = await loop.create_connection(lambda: _Protocol(clock), kw.get("host", "localhost"),
                                                            kw.get("port", 6379), ssl=self._ssl_context())
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
        setup = []
        if kw.get("password") is not None:
            user = (kw["username"],) if kw.get("username") else ()
            setup.append(("AUTH", *user, kw["password"]))
        if kw.get("db"):
            setup.append(("SELECT", kw["db"]))
        try:
            async with loop_timeout(self.timeout, "Redis did not answer the connection's setup", self.clock):
                for command in setup:
                    await proto.send(_pack(command))
        except BaseException:
            proto.abort(RedisConnectionError("connection setup failed"))
            raise
        self._proto = proto
        self._arm_watchdog()
        return proto

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.kwargs.get("connection_class") is None or "SSL" not in self.kwargs["connection_class"].__name__:
            return None
        ctx = ssl.create_default_context(cafile=self.kwargs.get("ssl_ca_certs"))
        if self.kwargs.get("ssl_certfile"):
            ctx.load_cert_chain(self.kwargs["ssl_certfile"], self.kwargs.get("ssl_keyfile"))
        if str(self.kwargs.get("ssl_cert_reqs", "required")).lower() == "none":
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def _arm_watchdog(self) -> None:
        """Every step (timeout / STEPS): the oldest reply awaited for `timeout` by the rule of state/stall.py
        (running-loop time, wall-time cap) closes the connection."""
        if self._watchdog is not None:  # a reconnect before the old one's last check: one chain only
            self._watchdog.cancel()
        self._watchdog = asyncio.get_running_loop().call_later(self.clock.step, self._check)

    def _check(self) -> None:
        self._watchdog = None
        proto = self._proto
        if proto is None or proto.closed:
            return
        self.clock.now()
        if proto.waiters:
            _, live, wall = proto.waiters[0]
            if overdue(self.clock, live, wall, self.timeout):
                proto.abort(RedisConnectionError(f"Redis did not answer within {self.timeout:g} s"))
                return
        self._arm_watchdog()

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._proto is not None:
            self._proto.abort(RedisConnectionError("state store closed"))
            self._proto = None
