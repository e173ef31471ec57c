"""One sandbox's budgets held exactly by gateway processes sharing one state store (gateway/shared/ledger.py).

Every test drives real `egressgate run` processes through their proxy listener with 64 concurrent
uploads (threads, raw sockets) to a counting upstream (tests/support/budgetworld.py) and compares three
figures: what the upstream received (heads + payload bytes, partial bodies of cut requests included),
what the store says is spent (read back through the gateway's own 429 "only N bytes remain"), and the
budget. Known-length uploads are paid exactly (the number that fit is arithmetic); chunked uploads are
paid from leases, paused while a top-up is in flight, cut only when the budget is really spent, and the
unused leases are given back so the store is exact once the uploads are over. A rule's `requests`
budget is checked and counted atomically by the store: concurrent requests cannot all pass on one
snapshot.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.support.budgetworld import (
    BudgetWorld,
    bytes_out,
    head,
    proxy_auth,
    read_status,
    send,
    start_gateways,
)
from tests.support.launcher import LoopbackGateway, stop_gateway
from tests.support.redis import RedisServer
from tests.support.waiting import wait_for

UPLOADS = 64
BODY = 10_000


def fleet_budgets(port: int) -> list[tuple[int, int]]:
    """Every (byte budget, rule request budget) the tests of this file run under, one policy each in the
    shared fleet: each test's own arithmetic (the test asks for its pair with `Fleet.admit`)."""
    known = len(head(port, "/k", f"Content-Length: {BODY}")) + BODY
    chunked = len(head(port, "/c", "Transfer-Encoding: chunked")) + 20 * 2000
    few = len(head(port, "/few", "Content-Length: 100")) + 100
    return [(20 * known + known // 2, 1000), (UPLOADS * chunked + 777, 1000), (1_000_000, 1000),
            (10_000_000, 10), (12 * few + few // 2, 30), (10_000_000, 30)]


@dataclass
class Fleet:
    """The gateways of one backend (memory: one process; redis: two on one Redis), started once for TestOneFleet
    with one policy per budget pair of `fleet_budgets`. Why sharing them cannot make one test see another's
    state: every test admits a sandbox of its own, and every figure a test asserts on is that sandbox's
    (its bytes_out, its rule's request count, the 429s of its requests: the store keys budgets, leases and
    history by sandbox id) or counted on the upstream from the test's own `mark()`; every test waits for all
    of its requests (fan_out) and for its leases to settle before it ends. Gateway starts were most of this
    file's CPU (~1.4 CPU-s each, 21 of them): now 3, plus the kill -9 and store-down tests' own."""

    gateways: list[LoopbackGateway]
    names: dict[tuple[int, int], str]

    def admit(self, bw: BudgetWorld, budget: int, requests_max: int = 1000) -> tuple[str, str]:
        """A new sandbox under the policy with exactly these budgets: (id, auth header line). First, the
        upstream is idle: a request an earlier test's gateway cut mid-body is recorded when the gateway
        closes that connection, which may come after the earlier test's last response (it must not land
        after this test's `mark()`)."""
        name = self.names.get((budget, requests_max))
        assert name is not None, f"add ({budget}, {requests_max}) to fleet_budgets"
        assert wait_for(bw.upstream.idle, timeout=30), "the upstream still has a connection open"
        return admit(self.gateways[0], name)


@pytest.fixture(scope="class", params=["memory", "redis"])
def fleet(request: pytest.FixtureRequest, bw: BudgetWorld) -> Iterator[Fleet]:
    """The state backend under test (memory: the embedded default, one process; redis: two processes on
    one Redis, a key prefix of their own) and its gateways."""
    backend = None
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        backend = {"backend": "redis", "url": server.url, "key_prefix": server.prefix()}
    names = {pair: f"exact-{pair[0]}-{pair[1]}" for pair in fleet_budgets(bw.upstream.port)}
    policies = [bw.policy(budget, requests_max, name) for (budget, requests_max), name in names.items()]
    gateways = start_gateways(bw, policies, backend, 2 if backend is not None else 1)
    try:
        yield Fleet(gateways, names)
    finally:
        for gw in gateways:
            stop_gateway(gw)


def gateways_for(bw: BudgetWorld, backend: dict | None, budget: int, requests_max: int = 1000):
    """Two gateway processes on one store when the backend is shared; one on memory."""
    return start_gateways(bw, bw.policy(budget, requests_max), backend, 2 if backend is not None else 1)


def admit(gw: LoopbackGateway, policy: str = "exact") -> tuple[str, str]:
    """A new sandbox (admitted on one gateway, known to all on a shared store): (id, auth header line)."""
    data = gw.admit_sandbox({"policy": policy, "labels": {}})
    return data["id"], proxy_auth(data["id"], data["token"])


def spent_everywhere(gateways: list[LoopbackGateway], sandbox_id: str) -> list[int]:
    return [bytes_out(gw, sandbox_id) for gw in gateways]


def fan_out(gateways: list[LoopbackGateway], count: int, call) -> list[tuple[int, bytes]]:
    """`count` concurrent calls, the i-th through gateway i % len(gateways)."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: call(gateways[i % len(gateways)].proxy), range(count)))


def rule_requests(gw: LoopbackGateway, sandbox_id: str, rule: str) -> int:
    """The store's request count of one rule, as the control API shows it."""
    import httpx

    res = httpx.get(f"http://{gw.admin}/v1/sandboxes/{sandbox_id}", headers={"Authorization": f"Bearer {gw.token}"},
                    timeout=10, trust_env=False)
    assert res.status_code == 200, res.text
    return int(res.json()["usage"]["rules"].get(rule, {}).get("requests", 0))


class TestOneFleet:
    """The tests on the shared fleet, in a class so the fleet (class-scoped) is stopped before the kill -9
    and store-down tests start gateways of their own: those run on a machine as quiet as before."""

    def test_known_length_uploads_hold_one_budget_exactly(self, bw: BudgetWorld, fleet: Fleet) -> None:
        port = bw.upstream.port
        size = len(head(port, "/k", f"Content-Length: {BODY}")) + BODY
        fit = 20
        budget = fit * size + size // 2  # room for 20 and a half: exactly 20 fit
        gateways = fleet.gateways
        sid, auth = fleet.admit(bw, budget)
        mark = bw.upstream.mark()
        results = fan_out(gateways, UPLOADS, lambda proxy: send(proxy, auth, port, "/k", b"k" * BODY))
        statuses = sorted(status for status, _ in results)
        assert statuses == [200] * fit + [429] * (UPLOADS - fit), statuses
        refused = [json.loads(body) for status, body in results if status == 429]
        assert {r["reason"] for r in refused} == {"budget_exceeded"}
        got = bw.upstream.since(mark)
        assert len(got) == fit and all(r.complete and r.body_len == BODY for r in got)
        assert bw.upstream.total(mark) == fit * size  # the gateway's count is what the upstream saw
        assert spent_everywhere(gateways, sid) == [fit * size] * len(gateways)  # one store, exact


    def test_chunked_uploads_use_the_whole_budget_and_no_more(self, bw: BudgetWorld, fleet: Fleet) -> None:
        """Leases are topped up while the streams pause: with room for all 64 uploads, none is cut (no
        false cut while budget remains), and once they are done the store is exact to the byte."""
        port = bw.upstream.port
        chunks = [b"c" * 2000] * 20
        size = len(head(port, "/c", "Transfer-Encoding: chunked")) + sum(map(len, chunks))
        slack = 777
        budget = UPLOADS * size + slack
        gateways = fleet.gateways
        sid, auth = fleet.admit(bw, budget)
        mark = bw.upstream.mark()
        results = fan_out(gateways, UPLOADS, lambda proxy: send(proxy, auth, port, "/c", None, chunks, 0.001))
        assert [status for status, _ in results] == [200] * UPLOADS
        assert bw.upstream.total(mark) == UPLOADS * size
        # leases settled once the uploads are over: spent is exactly what the upstream received
        assert wait_for(lambda: spent_everywhere(gateways, sid) == [UPLOADS * size] * len(gateways), timeout=5), \
            spent_everywhere(gateways, sid)


    def test_chunked_uploads_over_the_budget_are_cut_never_over(self, bw: BudgetWorld, fleet: Fleet) -> None:
        port = bw.upstream.port
        chunks = [b"d" * 4000] * 25  # 100 kB each, 6.4 MB asked for
        budget = 1_000_000
        gateways = fleet.gateways
        sid, auth = fleet.admit(bw, budget)
        mark = bw.upstream.mark()
        results = fan_out(gateways, UPLOADS, lambda proxy: send(proxy, auth, port, "/d", None, chunks, 0.001))
        statuses = [status for status, _ in results]
        # cut: the budget could not hold them all; each cut upload's client reads the 429 deny (before,
        # a reset: status 0), so does one that starts once the budget is spent
        assert 429 in statuses
        assert set(statuses) <= {200, 429}
        received = bw.upstream.total(mark)
        spent = bytes_out(gateways[0], sid)
        # never over; what reached the upstream was paid for (a cut socket may lose its last bytes)
        assert received <= spent <= budget
        assert spent > budget - 2 * 4000 * UPLOADS // 4  # and the budget was used, not stranded in leases
        completed = [r for r in bw.upstream.since(mark) if r.complete]
        assert all(r.body_len == 100_000 for r in completed)


    def test_rule_request_budget_is_exact_under_concurrency(self, bw: BudgetWorld, fleet: Fleet) -> None:
        """`budget.requests: 10` on a rule: of 64 concurrent requests exactly 10 reach the upstream; decide()
        alone (one snapshot shared by concurrent requests) let more through. Control: the sandbox's other rule
        still serves it afterwards."""
        port = bw.upstream.port
        gateways = fleet.gateways
        sid, auth = fleet.admit(bw, 10_000_000, 10)
        mark = bw.upstream.mark()
        results = fan_out(gateways, UPLOADS, lambda proxy: send(proxy, auth, port, "/few", b"f" * 100))
        statuses = sorted(status for status, _ in results)
        assert statuses == [200] * 10 + [429] * (UPLOADS - 10), statuses
        refused = [json.loads(body) for status, body in results if status == 429]
        assert {(r["reason"], r["rule"]) for r in refused} == {("budget_exceeded", "few")}
        assert len([r for r in bw.upstream.since(mark) if r.path == "/few"]) == 10
        assert send(gateways[-1].proxy, auth, port, "/other", b"o")[0] == 200  # positive control
        # refused ones were never counted against the byte budget: 10 + 1 requests are spent
        assert wait_for(lambda: spent_everywhere(gateways, sid) == [bw.upstream.total(mark)] * len(gateways),
                        timeout=5), (spent_everywhere(gateways, sid), bw.upstream.total(mark))


    def test_byte_and_rule_budgets_in_one_step_stay_exact(self, bw: BudgetWorld, fleet: Fleet) -> None:
        """The bytes of a request, its rule's budget and its history are one atomic store step (issue 25): with
        room for 12 requests in the byte budget and 30 in the rule's, exactly 12 of 64 concurrent requests (on
        two gateway processes sharing one Redis) pass; the 52 refused for their bytes are not counted against
        the rule (all or nothing), so its count is exactly 12 and the bytes spent are what the upstream got.
        Control: the rule's own budget refuses once it is spent (30), the byte budget is not what stops it."""
        port = bw.upstream.port
        size = len(head(port, "/few", "Content-Length: 100")) + 100
        gateways = fleet.gateways
        sid, auth = fleet.admit(bw, 12 * size + size // 2, 30)
        mark = bw.upstream.mark()
        results = fan_out(gateways, UPLOADS, lambda proxy: send(proxy, auth, port, "/few", b"f" * 100))
        statuses = sorted(status for status, _ in results)
        assert statuses == [200] * 12 + [429] * (UPLOADS - 12), statuses
        refused = [json.loads(body) for status, body in results if status == 429]
        assert {r["reason"] for r in refused} == {"budget_exceeded"}
        # refused for their bytes (the rule's budget had room): no rule named, the byte budget's message
        assert all(r["rule"] is None and r["message"].startswith("This request needs") for r in refused), refused[:2]
        assert len(bw.upstream.since(mark)) == 12 and bw.upstream.total(mark) == 12 * size
        assert [rule_requests(gw, sid, "few") for gw in gateways] == [12] * len(gateways)
        assert spent_everywhere(gateways, sid) == [12 * size] * len(gateways)
        # control: a byte budget with room for all, a rule budget of 30: the rule is what refuses now
        sid, auth = fleet.admit(bw, 10_000_000, 30)
        results = fan_out(gateways, UPLOADS, lambda proxy: send(proxy, auth, port, "/few", b"f" * 100))
        assert sorted(status for status, _ in results) == [200] * 30 + [429] * (UPLOADS - 30)
        refused = [json.loads(body) for status, body in results if status == 429]
        assert {(r["reason"], r["rule"]) for r in refused} == {("budget_exceeded", "few")}  # the rule's, not bytes
        assert [rule_requests(gw, sid, "few") for gw in gateways] == [30] * len(gateways)


def test_kill_9_mid_upload_survivor_serves_total_never_over(bw: BudgetWorld, redis_server: RedisServer) -> None:
    """Two processes on one Redis; one is killed (-9) while it relays chunked uploads holding a lease.
    The survivor keeps serving, the total spent never passes the budget (the dead lease stays spent),
    and the dead worker's lease is reconciled and audited exactly once (heartbeat TTL, then a reconcile
    round of the survivor). The TTL is 5 s here instead of the default 15 s (state.heartbeat_ttl_seconds):
    the same expiry, sooner; the survivor still refreshes its own key every third of it."""
    port = bw.upstream.port
    backend = {"backend": "redis", "url": redis_server.url, "key_prefix": redis_server.prefix(),
               "heartbeat_ttl_seconds": 5}
    budget = 8_000_000  # room for every upload: a cut here is the kill's doing, not the budget's
    survivor, doomed = gateways_for(bw, backend, budget)
    try:
        sid, auth = admit(survivor)
        mark = bw.upstream.mark()
        chunks = [b"s" * 4000] * 60  # 240 kB each, paced: still running when the kill comes
        with ThreadPoolExecutor(UPLOADS) as pool:
            futures = [pool.submit(send, (doomed if i % 2 else survivor).proxy, auth, port, "/c", None, chunks, 0.02)
                       for i in range(UPLOADS // 2)]
            assert wait_for(lambda: bytes_out(survivor, sid) > 200_000, timeout=10)
            doomed.proc.kill()  # kill -9 mid-upload
            doomed.proc.wait(10)
            samples = []
            while not all(f.done() for f in futures):
                samples.append(bytes_out(survivor, sid))
                assert send(survivor.proxy, auth, port, "/k", b"k" * 1000)[0] == 200  # survivor serves
            statuses = [f.result()[0] for f in futures]
        assert statuses[0::2] == [200] * (UPLOADS // 4)  # the survivor's uploads all completed
        assert 0 in statuses[1::2]  # the doomed process's were cut by its death
        received = bw.upstream.total(mark)
        spent = bytes_out(survivor, sid)
        assert max(samples) <= budget and received <= spent <= budget

        def reconciled() -> list[dict]:
            return [r for r in survivor.audit_records() if r.get("egressgate.operation") == "budget_reconcile"]

        assert wait_for(reconciled, timeout=40, interval=0.5), "dead worker's lease never reconciled"
        time.sleep(6)  # another reconcile round: the forfeited lease is not audited twice
        [record] = reconciled()
        assert record["egressgate.sandbox.id"] == sid
        assert int(record["egressgate.forfeited_bytes"]) > 0
        assert bytes_out(survivor, sid) == spent  # forfeited bytes stay spent (they may have gone out)
    finally:
        stop_gateway(survivor)
        stop_gateway(doomed)


def test_store_down_mid_stream_cuts_and_says_state_unavailable(bw: BudgetWorld, tmp_path) -> None:
    """A chunked upload whose lease runs dry after Redis stopped: the top-up cannot be made, so the body
    is cut (fail closed: the upstream never sees it complete) and its outcome record is `deny`
    `state_unavailable`, not a budget cut. Positive control: the same upload completes while Redis is up."""
    port = bw.upstream.port
    with RedisServer(tmp_path / "redis") as server:
        [gw] = start_gateways(bw, bw.policy(10_000_000, 1000),
                              {"backend": "redis", "url": server.url, "key_prefix": server.prefix()}, 1)
        try:
            sid, auth = admit(gw)
            mark = bw.upstream.mark()
            assert send(gw.proxy, auth, port, "/c", None, [b"u" * 50_000] * 4)[0] == 200  # control
            assert [r.complete for r in bw.upstream.since(mark)] == [True]
            mark = bw.upstream.mark()
            with socket.create_connection(gw.proxy, timeout=10) as sock:
                sock.sendall(f"POST http://up.test:{port}/c HTTP/1.1\r\nHost: up.test:{port}\r\n{auth}"
                             "Transfer-Encoding: chunked\r\n\r\n".encode() + b"100\r\n" + b"v" * 256 + b"\r\n")
                time.sleep(0.5)  # the first lease (4 KiB) is granted
                server.stop()
                try:
                    for _ in range(20):  # 400 kB: far more than the lease holds
                        sock.sendall(b"4e20\r\n" + b"w" * 20_000 + b"\r\n")
                    sock.sendall(b"0\r\n\r\n")
                    status = read_status(sock)[0]
                except OSError:
                    status = 0
            assert status == 403  # cut: the upstream request aborted, the client told why (state_unavailable)
            assert not any(r.complete for r in bw.upstream.since(mark))

            def outcome() -> dict | None:
                return next((r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sid
                             and r.get("egressgate.operation") == "outcome"
                             and r.get("egressgate.decision") == "deny"), None)

            assert wait_for(outcome, timeout=5), [r for r in gw.audit_records()
                                                  if r.get("egressgate.sandbox.id") == sid]
            record = outcome()
            assert record["egressgate.reason"] == "state_unavailable" and "egressgate.budget_cut" not in record
        finally:
            stop_gateway(gw)
