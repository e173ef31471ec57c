"""Tokens bound to their admitted addresses on the Redis backend: two real gateways on one real Redis; a
sandbox admitted on one with an address is refused (407 `identity_address_mismatch`, audited) on either
replica when its token comes from another address, and served from its own address by both (the
binding travels with the record through Redis, not only in the admitting process's memory)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.gwworld import Gateway, World, start_gateway
from tests.support.redis import RedisServer
from tests.support.replicas import gateway_pair
from tests.support.sources import admit, connect_from, fresh_address, mismatch_records, plain_from
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def pair(world: World, redis_server: RedisServer,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Gateway]]:
    with gateway_pair(start_gateway, world, redis_server, lambda n: tmp_path_factory.mktemp(f"ta-{n}")) as ab:
        yield ab


def test_token_bound_to_its_address_on_both_replicas(pair: tuple[Gateway, Gateway]) -> None:
    a, b = pair
    own, other = fresh_address(), fresh_address()
    sbx = admit(a, [own])
    thief = admit(b, [other])  # another sandbox, admitted on the other replica, holds `other`
    mark = a.world.hits.mark()
    try:
        for gw in (a, b):
            status, body = plain_from(gw, other, sbx, "/echo/stolen")
            assert status == 407 and b"identity_address_mismatch" in body, body
            status, body, sock = connect_from(gw, other, sbx, f"api.test:{gw.world.https_port}")
            sock.close()
            assert status == 407 and b"identity_address_mismatch" in body, body
        assert a.world.hits.since(mark) == []  # nothing reached the upstream
        # positive control: from its own address, on both replicas
        assert plain_from(a, own, sbx, "/echo/own-a")[0] == 200
        assert plain_from(b, own, sbx, "/echo/own-b")[0] == 200
        assert sorted(h["path"] for h in a.world.hits.since(mark)) == ["/echo/own-a", "/echo/own-b"]
        for gw in (a, b):
            assert wait_for(lambda gw=gw: len(mismatch_records(gw, sbx.id)) == 2, timeout=10)
            assert all(r.get("client.address") == other for r in mismatch_records(gw, sbx.id))
    finally:
        a.revoke(sbx.id)
        b.revoke(thief.id)
