"""The multiplexed connection (egressgate/state/resp.py): replies always reach the caller that asked,
whatever arrives split, late, or for a caller that went away."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from egressgate.state.base import StateUnavailable
from egressgate.state.redis import RedisState
from egressgate.state.resp import _INCOMPLETE, RespConnection, pack, parse
from tests.state.helpers import record, redis_store
from tests.support.redis import RedisServer

REPLIES = [
    (b"+PONG\r\n", "PONG"),
    (b":-42\r\n", -42),
    (b"$5\r\nh\r\nlo\r\n", "h\r\nlo"),  # a bulk string holding CRLF
    (b"$-1\r\n", None),
    (b"*3\r\n$1\r\na\r\n*2\r\n:1\r\n$0\r\n\r\n*0\r\n", ["a", [1, ""], []]),
]


@pytest.mark.parametrize(("wire", "value"), REPLIES)
def test_every_split_of_a_reply_parses_to_the_same_value(wire: bytes, value):
    for cut in range(len(wire)):
        head = bytearray(wire[:cut])
        assert parse(head, 0) == (_INCOMPLETE, 0)  # never a value from a partial reply
    assert parse(bytearray(wire + b"+NEXT\r\n"), 0) == (value, len(wire))


def test_error_replies_are_exceptions():
    err, _ = parse(bytearray(b"-NOSCRIPT No matching script\r\n"), 0)
    assert isinstance(err, redis.exceptions.NoScriptError)
    err, _ = parse(bytearray(b"-WRONGTYPE Operation\r\n"), 0)
    assert isinstance(err, redis.exceptions.ResponseError) and "WRONGTYPE" in str(err)


async def test_replies_match_callers_under_concurrency(redis_server: RedisServer):
    conn = RespConnection(redis_server.url, timeout=2, connect_timeout=1)
    try:
        key = redis_server.prefix() + "echo"
        values = [f"v{i}" * (i % 50 + 1) for i in range(300)]
        got = await asyncio.gather(*(conn.call("EVAL", "return ARGV[1]", 1, key, v) for v in values))
        assert got == values
        assert pack(("SET", b"k", 1)) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n"
    finally:
        conn.close()


async def test_cancelled_callers_do_not_shift_the_replies(redis_server: RedisServer):
    store = await redis_store(redis_server)
    try:
        await store.admit(record())
        assert await store.reserve_out("sbx", 1, 1, None) == 1  # connected, script loaded (no NOSCRIPT below)
        tasks = [asyncio.create_task(store.reserve_out("sbx", 1, 1, None)) for _ in range(40)]
        proto = store._link._conn._proto
        assert proto is not None
        while len(proto.waiters) < 40:  # every command sent (or about to be); now half the callers go away
            await asyncio.sleep(0)
        for task in tasks[::2]:
            task.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(r == 1 for r in done[1::2])
        spent = (await store.snapshot("sbx")).bytes_out
        assert spent == 41  # the cancelled callers' commands ran; their replies were dropped, not shifted
        assert await store.reserve_out("sbx", 7, 7, None) == 7
        assert (await store.snapshot("sbx")).bytes_out == spent + 7
        got = await store.get("sbx")
        assert got is not None and got.id == "sbx"
    finally:
        await store.close()


async def test_a_late_reply_closes_the_connection_and_the_next_command_is_answered_right(redis_server: RedisServer):
    """Redis stops answering (CLIENT PAUSE) past the timeout: the waiting commands fail closed and the
    connection is dropped, so the late replies can never be handed to later commands."""
    store = await redis_store(redis_server, timeout=0.5)
    other = redis.Redis.from_url(redis_server.url)
    try:
        await store.admit(record())
        await store.reserve_out("sbx", 10, 10, None)
        other.client_pause(1500, all=True)
        start = time.monotonic()
        with pytest.raises(StateUnavailable):
            await store.reserve_out("sbx", 5, 5, None)
        assert 0.4 < time.monotonic() - start < 1.4
        await asyncio.sleep(1.2)  # the pause ends; the paused command runs (Redis had read it)
        snap = await store.snapshot("sbx")
        assert snap.bytes_out in (10, 15)  # spent counts what may have gone out: never less
        assert await store.reserve_out("sbx", 3, 3, None) == 3
        assert await store.record_request("sbx", "a.example", "r1", 1) is True
        assert (await store.snapshot("sbx")).bytes_out == snap.bytes_out + 3
    finally:
        other.close()
        await store.close()


async def test_a_silent_server_fails_every_waiting_command_within_the_timeout():
    """A peer that accepts and never answers (a hung Redis): every in-flight command fails closed once,
    together, after the timeout, instead of one after another."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisState(f"redis://127.0.0.1:{port}/0", "r12silent:", timeout=0.5)
    try:
        start = time.monotonic()
        results = await asyncio.gather(*(store.reserve_out("sbx", 1, 1, None) for _ in range(20)),
                                       return_exceptions=True)
        elapsed = time.monotonic() - start
        assert all(isinstance(r, StateUnavailable) for r in results), results
        assert 0.4 < elapsed < 1.5, elapsed
        assert store.errors == 20
    finally:
        await store.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
