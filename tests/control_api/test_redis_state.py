"""The control API on the Redis state backend (a real `redis-server` the test starts on a free loopback port):

- two gateways on one Redis: a sandbox admitted on one is listed and shown by the other (the list reads
  the shared registry; connections are per process);
- Redis stopped: /readyz 503 naming `state`, a sandbox's request is denied `state_unavailable`, and
  `egressgate_state_errors_total` moves (it stays put while Redis is up: negative control); Redis back:
  /readyz 200 again without a gateway restart.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.control_api.harness import METRICS_POLICY, SCRAPED_BY, api, scrape, start_control_gateway, value
from tests.support.redis import RedisServer
from tests.support.replay_check import stop_and_replay
from tests.support.waiting import wait_for


@pytest.fixture
def redis(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _state(redis: RedisServer, prefix: str) -> dict:
    return {"state": {"backend": "redis", "url": redis.url, "key_prefix": prefix}}


def test_two_gateways_share_the_registry_the_api_shows(world, tmp_path, redis):
    prefix = redis.prefix()
    one = start_control_gateway(world, tmp_path / "one", _state(redis, prefix))
    try:
        two = start_control_gateway(world, tmp_path / "two", _state(redis, prefix))
        try:
            sbx = one.admit(METRICS_POLICY, labels={"team": "c12redis"})
            with sbx.client() as c:
                assert c.get(sbx.url("api.test", "/echo")).status_code == 200
                listed = api(two, "GET", "/v1/sandboxes").json()["sandboxes"]
                (entry,) = [s for s in listed if s["id"] == sbx.id]
                assert entry["labels"] == {"team": "c12redis"}
                assert entry["connections"] == 0  # the open connection is held by the other process
                assert api(one, "GET", f"/v1/sandboxes/{sbx.id}").json()["connections"] == 1
            detail = api(two, "GET", f"/v1/sandboxes/{sbx.id}").json()
            assert detail["budgets"]["rules"]["c12-get"]["requests"] == {"limit": 3, "used": 1, "left": 2}
            assert detail["usage"]["bytes_out"] > 0
        finally:
            stop_and_replay(two)
    finally:
        stop_and_replay(one)


def test_redis_outage_makes_the_gateway_unready_and_counts_state_errors(world, tmp_path, redis):
    gw = start_control_gateway(world, tmp_path / "gw", _state(redis, redis.prefix()))
    try:
        sbx = gw.admit(METRICS_POLICY)
        with sbx.client() as c:
            assert c.get(sbx.url("api.test", "/echo")).status_code == 200
        ready = api(gw, "GET", "/readyz", token=None)
        assert ready.status_code == 200 and ready.json()["components"]["state"] == {"status": "ok"}
        healthy = scrape(gw)
        assert value(healthy, "egressgate_state_errors_total") == 0  # negative control: Redis up, no errors

        redis.stop()
        assert wait_for(lambda: api(gw, "GET", "/readyz", token=None).status_code == 503, timeout=10)
        body = api(gw, "GET", "/readyz", token=None).json()
        assert body["components"]["state"]["status"] == "unavailable"
        assert redis.url not in str(body) and str(redis.port) not in str(body)  # public: no backend address
        assert body["components"]["audit"]["status"] == "ok"
        with sbx.client() as c:  # plain HTTP: the deny body is readable (a refused CONNECT is an httpx error)
            denied = c.get(sbx.url("api.test", "/v1/while-down", scheme="http"))
        assert denied.status_code == 403 and denied.json()["reason"] == "state_unavailable", denied.text
        assert value(scrape(gw), "egressgate_state_errors_total") > 0
        listing = api(gw, "GET", "/v1/sandboxes")
        assert listing.status_code == 503 and listing.json()["error"] == "state_unavailable"

        redis.start()
        assert wait_for(lambda: api(gw, "GET", "/readyz", token=None).status_code == 200, timeout=15)
        assert api(gw, "GET", "/v1/sandboxes").status_code == 200
    finally:
        stop_and_replay(gw)


@pytest.mark.timeout(600)  # a 2-worker start, 140 admin calls and a replay: over 120 s on a loaded 2-core machine
def test_workers_share_one_admin_address_and_their_series_never_mix(world, tmp_path, redis):
    """`run --workers 2`: scrapes of the one admin address reach both workers; every sample carries its
    worker, and each worker's counter only grows. Positive control: read without the label, at least one
    worker's scrape reports fewer than the 40 admissions, so a merged series would be wrong whenever that
    worker answers. Deterministic: it holds however the kernel spreads connections (not "the merged series
    goes backwards", which depends on whether scrapes happen to alternate between workers)."""
    gw = start_control_gateway(world, tmp_path / "gw", _state(redis, redis.prefix()), args=["--workers", "2"])
    try:
        series: list[tuple[str, float]] = []
        for _ in range(40):
            api(gw, "POST", "/v1/sandboxes", json={"policy": METRICS_POLICY})  # one admission record each
            samples = scrape(gw)
            (worker,) = [dict(k[1])["worker"] for k in samples if k[0] == SCRAPED_BY]
            admitted = sum(n for (name, labels), n in samples.items()
                           if name == "egressgate_decisions_total" and ("operation", "admission") in labels)
            series.append((worker, admitted))
        final: dict[str, float] = {}  # after the traffic: each worker's total, from a scrape it answered
        for _ in range(60):
            samples = scrape(gw)
            (worker,) = [dict(k[1])["worker"] for k in samples if k[0] == SCRAPED_BY]
            final[worker] = sum(n for (name, labels), n in samples.items()
                                if name == "egressgate_decisions_total" and ("operation", "admission") in labels)
            if len(final) == 2:
                break
    finally:
        stop_and_replay(gw)
    workers = {w for w, _ in series}
    assert len(workers) == 2, series
    for worker in workers:
        mine = [n for w, n in series if w == worker]
        assert mine == sorted(mine), (worker, mine)  # each worker's counter only grows
    assert set(final) == workers and sum(final.values()) == 40  # summed by worker: exactly the admissions
    assert min(final.values()) < 40, final  # positive control: an unlabelled scrape under-reports
