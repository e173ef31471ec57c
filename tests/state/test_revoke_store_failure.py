"""DELETE /v1/sandboxes/{id} while the shared store cannot take the write.

Under Redis the admin API finds the record in its process cache (no round trip), writes the revocation's
audit record, then calls state.revoke(); when that write fails (Redis paused, failing over, timing out)
the StateUnavailable escapes the handler: the operator gets a 500 `internal_error` ("see its log")
although the audit trail already says the sandbox was revoked, and nothing tells them the revocation did
happen (here Redis ran the paused write later; after a real failure the sandbox keeps working on every
replica). It must answer 503 `state_unavailable` (retry),
like every other route whose store call fails, and say the revocation was not applied.

Redis is made to refuse writes deterministically with `CLIENT PAUSE <ms> WRITE` (reads, the pub/sub
subscription and its pings go on, so the cached record is still served).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import redis

from tests.support.gwworld import World, open_world, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.redis import RedisServer
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("v12-world")) as w:
        yield w


def test_a_revocation_the_store_did_not_take_is_a_503_not_a_silent_500(world: World, tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        state = {"state": {"backend": "redis", "url": server.url, "key_prefix": server.prefix()}}
        gw = start_gateway(world, tmp_path / "gw", state)
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        try:
            sbx = gw.admit("gw-basic")
            with sbx.client() as c:
                assert c.get(sbx.url("api.test", "/echo")).status_code == 200  # cached in the gateway now
            admin.execute_command("CLIENT", "PAUSE", "4000", "WRITE")
            try:
                res = gw.revoke(sbx.id)
            finally:
                admin.execute_command("CLIENT", "UNPAUSE")
            assert res.status_code == 503, res.text
            assert res.json()["error"] == "state_unavailable", res.text
            # whether the paused write ran after all is unknown to the gateway (Redis ran it at UNPAUSE here):
            # the 503 tells the operator to retry, and the retry revokes
            assert wait_for(lambda: gw.revoke(sbx.id).status_code == 200, timeout=10)
            with sbx.client() as c, pytest.raises(httpx.ProxyError, match=r"40[37]"):  # CONNECT refused
                c.get(sbx.url("api.test", "/echo"))
            # the trail says what happened: the refused attempt, then the revocation that took effect
            records = [(r["egressgate.decision"], r.get("egressgate.reason")) for r in gw.audit_records()
                       if r.get("egressgate.operation") == "revocation" and r.get("egressgate.sandbox.id") == sbx.id]
            assert records[0] == ("deny", "state_unavailable") and records[-1][0] == "allow", records
        finally:
            admin.close()
            stop_gateway(gw)
