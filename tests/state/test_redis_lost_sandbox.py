"""What a sandbox's clients read after Redis lost its data (issue 23 item 6; docs/operations.md, "State").

A real gateway on its own redis-server. Two tunnels of one sandbox are bound before a FLUSHALL; after it:
the first request (its record still in the replica's cache) and the second (on the other tunnel, after
the cache dropped the record) are both refused `state_unavailable` — before, the second said
`sandbox_revoked` although nobody revoked anything. A new connection with the same id and token gets
`407 identity_unknown`, as any identity the gateway cannot verify (the token's digest went with the
data; a different answer would tell an unauthenticated client which ids once existed), with a message
that says a new admission is needed. Positive control: the same requests pass before the FLUSHALL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.gwworld import World, connect_tunnel, open_world, start_gateway, tls_wrap
from tests.support.http1 import read_reply
from tests.support.launcher import stop_gateway
from tests.support.redis import RedisServer


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("lost-world")) as w:
        yield w


def _get(tls, port: int) -> tuple[int, dict, bytes]:
    tls.sendall(f"GET /echo HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n".encode())
    return read_reply(tls)


def test_requests_of_a_sandbox_redis_forgot(world: World, tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as server:
        gw = start_gateway(world, tmp_path / "gw", {"state": {"backend": "redis", "url": server.url}})
        try:
            sbx = gw.admit("gw-basic")
            port = world.https_port
            tunnels = []
            for _ in range(2):
                sock, head = connect_tunnel(gw, sbx, f"api.test:{port}")
                assert head.startswith(b"HTTP/1.1 200"), head
                tunnels.append(tls_wrap(sock, gw, "api.test"))
            for tls in tunnels:  # positive control: both tunnels serve this sandbox
                assert _get(tls, port)[0] == 200
            redis.Redis.from_url(server.url).flushall()
            for tls in tunnels:
                status, headers, body = _get(tls, port)
                doc = json.loads(body)
                assert (status, doc["reason"]) == (403, "state_unavailable"), (status, body)
                assert headers.get("x-egressgate-decision") == "deny"
                tls.close()
            sock, head = connect_tunnel(gw, sbx, f"api.test:{port}")
            sock.close()
            assert head.startswith(b"HTTP/1.1 407") and b"identity_unknown" in head, head
            assert b"new admission" in head, head
            fresh = gw.admit("gw-basic")  # a new admission works at once
            sock, head = connect_tunnel(gw, fresh, f"api.test:{port}")
            with tls_wrap(sock, gw, "api.test") as tls:
                assert head.startswith(b"HTTP/1.1 200") and _get(tls, port)[0] == 200
        finally:
            stop_gateway(gw)
