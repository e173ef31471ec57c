"""Two real gateways (`egressgate run`) on one Redis (`state: {backend: redis}`): a sandbox admitted on
one is served by the other, and a revocation on one closes a stream held open through the other."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gwworld import Gateway, Sandbox, World, connect_tunnel, open_world, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.redis import RedisServer
from tests.support.replicas import gateway_pair, hold_sse, through
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("r12-world")) as w:
        yield w


@pytest.fixture(scope="module")
def pair(world: World, redis_server: RedisServer,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Gateway]]:
    with gateway_pair(start_gateway, world, redis_server, lambda n: tmp_path_factory.mktemp(f"r12-{n}")) as ab:
        yield ab


def test_admitted_on_one_gateway_served_by_the_other(pair: tuple[Gateway, Gateway]):
    a, b = pair
    sbx = a.admit("gw-basic")
    mark = a.world.hits.mark()
    with through(sbx, b).client() as c:
        r = c.get(sbx.url("api.test", "/echo"))
    assert r.status_code == 200
    assert len(a.world.hits.since(mark)) == 1
    wrong = Sandbox(id=sbx.id, token=sbx.token + "x", proxy_url=through(sbx, b).proxy_url.replace(
        sbx.token, sbx.token + "x"), env={}, gw=b)
    sock, head = connect_tunnel(b, wrong, f"api.test:{a.world.https_port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 407") and b"identity_unknown" in head


def test_revocation_on_one_gateway_closes_a_stream_held_through_the_other(pair: tuple[Gateway, Gateway]):
    a, b = pair
    sbx = a.admit("gw-basic")
    via_b = through(sbx, b)
    key = uuid.uuid4().hex
    held = hold_sse(via_b, key, hold=180)  # the upstream holds 180 s; the client never times out
    try:
        assert held.wait_first()
        r = a.revoke(sbx.id)  # on the other gateway
        assert r.status_code == 200 and r.json()["revoked"] is True
        assert held.join(60), "the stream outlived the revocation"
        assert "data: last" not in held.outcome.get("lines", []), held.outcome  # cut, not the hold's end
    finally:
        a.world.release_sse(key)
    sock, head = connect_tunnel(b, via_b, f"api.test:{a.world.https_port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 407") and b"sandbox_revoked" in head


@pytest.mark.parametrize("target", ["tcp.test", "open.test"])
def test_redis_down_after_connect_refuses_the_tunnels_bytes(world: World, tmp_path: Path, target: str):
    """A tunnel opened while Redis was up; Redis stops before its first bytes: the raw-TCP decision
    cannot read the sandbox's state, so nothing reaches the upstream (fail closed, not a relay)."""
    with RedisServer(tmp_path / "redis") as server:
        gw = start_gateway(world, tmp_path / "gw", {"state": {"backend": "redis", "url": server.url}})
        try:
            sbx = gw.admit("gw-tcp")
            port = world.tcp_port
            sock, head = connect_tunnel(gw, sbx, f"tcp.test:{port}")  # positive control: relayed
            sock.sendall(b"\x00control")
            sock.settimeout(5)
            assert sock.recv(100) == b"echo:\x00control"
            sock.close()
            sock, head = connect_tunnel(gw, sbx, f"{target}:{port}")
            assert head.startswith(b"HTTP/1.1 200")
            before = len(world.hits.tcp)
            server.stop()
            sock.sendall(b"\x00after-redis-stopped")
            sock.settimeout(5)
            try:
                reply = sock.recv(200)
            except OSError:
                reply = b""
            sock.close()
            time.sleep(0.3)
            assert not reply.startswith(b"echo:"), reply
            assert all(b"after-redis-stopped" not in d for d in world.hits.tcp[before:])
            if target == "tcp.test":
                # relayed by its rule: the ledger's lease top-up failed; the relay's outcome says why (the
                # store, not the budget and not a gateway bug)
                def relay_outcome() -> dict | None:
                    return next((r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sbx.id
                                 and r.get("egressgate.operation") == "outcome"
                                 and r.get("egressgate.decision") == "deny"), None)

                assert wait_for(relay_outcome, timeout=5), [r for r in gw.audit_records()
                                                             if r.get("egressgate.sandbox.id") == sbx.id]
                out = relay_outcome()
                assert out["egressgate.reason"] == "state_unavailable" and "egressgate.budget_cut" not in out, out
                return
            # ...and the raw-TCP decision's refusal says why: the store, not a gateway bug
            reasons = [r.get("egressgate.reason") for r in gw.audit_records()
                       if r.get("egressgate.sandbox.id") == sbx.id and r.get("egressgate.decision") == "deny"]
            assert "state_unavailable" in reasons and "internal_error" not in reasons, reasons
        finally:
            stop_gateway(gw)
