"""A byte-budget refusal's record carries the figure the store's check read, so audit replay refuses it again.

docs/audit.md: a request of known size refused `budget_exceeded` (detail `outbound_bytes_max`) records
`egressgate.budget.needed` and `egressgate.budget.spent` ("the bytes already spent or leased — the inputs
of that check"), and replay re-applies `needed + spent > outbound_bytes_max`. The store's figure counts
every lease as spent, this process's pool included. Before commit 03d0f10 the record carried
`limit - remaining`, where `remaining` added back what this process's pool held *when the answer came
back*: when another flow's lease landed while the refused request's store step was in flight, the record
showed room the check never saw, and replay flipped `deny budget_exceeded -> allow` (seen once at the
teardown replay of test_budget_exact.py under load).

Here that interleaving is forced (reserve_gate_launcher.py holds the request's store step until the test
says go; no timing): a chunked upload holds the sandbox's pool, a known-length request sized to fit
exactly once the upload's lease is settled reaches the store step and is held, the upload's next chunk
takes a new lease, and only then does the store check run: refused (the lease counts as spent). Its record
must replay as the same deny. Positive control: once the upload has ended (its lease settled) the very
same request fits to the byte and is allowed, and replays as allowed.
"""

from __future__ import annotations

import json
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from egressgate.audit.find import iter_records
from egressgate.audit.replay import load_policy_set, replay_records
from tests.support.budgetworld import HOST, BudgetWorld, bytes_out, head, proxy_auth, read_status, start_gateways
from tests.support.launcher import stop_gateway
from tests.support.replay_check import assert_config_replays, trail_files
from tests.support.waiting import wait_for

LAUNCHER = Path(__file__).with_name("reserve_gate_launcher.py")
BUDGET = 40_000  # a lease is at most BUDGET // 16 = 2500 bytes: the upload's chunks below are smaller
FIRST, SECOND = 1000, 100  # the upload's chunks before and while the refused request is in flight
HANG_GUARD = 300  # seconds: a hang guard only (the request waits for the gate), never a speed check


def post(proxy: tuple[str, int], auth: str, port: int, body: int) -> tuple[int, bytes]:
    """budgetworld.send's Content-Length POST to `/k`, with a socket timeout that is only a hang guard."""
    with socket.create_connection(proxy, timeout=HANG_GUARD) as sock:
        sock.sendall(
            f"POST http://{HOST}:{port}/k HTTP/1.1\r\nHost: {HOST}:{port}\r\n{auth}"
            f"Content-Length: {body}\r\n\r\n".encode()
            + b"k" * body
        )
        return read_status(sock)


def known_request_body(port: int, total: int) -> int:
    """The body size of a `/k` POST whose head + body is `total` bytes (the head names the size)."""
    body = total
    while len(head(port, "/k", f"Content-Length: {body}")) + body != total:
        body = total - len(head(port, "/k", f"Content-Length: {body}"))
    return body


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_refused_request_replays_as_the_same_deny(bw: BudgetWorld, backend: str, request, tmp_path) -> None:
    port = bw.upstream.port
    state = None
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        state = {"backend": "redis", "url": server.url, "key_prefix": server.prefix()}
    gate = tmp_path / "gate"
    gate.mkdir()
    policy = bw.policy(BUDGET, 1000, f"refusal-{backend}")
    [gw] = start_gateways(bw, policy, state, 1, launcher=[sys.executable, str(LAUNCHER), str(gate)])
    try:
        data = gw.admit_sandbox({"policy": policy["sandbox"]["name"], "labels": {}})
        sid, auth = data["id"], proxy_auth(data["id"], data["token"])
        upload_head = len(head(port, "/c", "Transfer-Encoding: chunked"))
        # sized to fit to the byte once the upload (head + both chunks) is all that is spent
        total = BUDGET - upload_head - FIRST - SECOND
        body = known_request_body(port, total)
        with socket.create_connection(gw.proxy, timeout=HANG_GUARD) as upload, ThreadPoolExecutor(1) as pool:
            upload.sendall(
                f"POST http://{HOST}:{port}/c HTTP/1.1\r\nHost: {HOST}:{port}\r\n{auth}"
                "Transfer-Encoding: chunked\r\n\r\n".encode()
                + f"{FIRST:x}\r\n".encode()
                + b"a" * FIRST
                + b"\r\n"
            )
            # the first chunk is paid from a lease of this process's pool (what the control API shows:
            # the store's figure less what the pool holds unsent)
            assert wait_for(lambda: bytes_out(gw, sid) == upload_head + FIRST), bytes_out(gw, sid)
            (gate / "arm").write_text("")
            refused = pool.submit(post, gw.proxy, auth, port, body)
            assert wait_for(lambda: (gate / "arrived").exists()), "the request never reached its store step"
            before = bytes_out(gw, sid)
            # the upload's next chunk, while the request's store step is held: a new lease lands in the pool
            upload.sendall(f"{SECOND:x}\r\n".encode() + b"b" * SECOND + b"\r\n")
            assert wait_for(lambda: bytes_out(gw, sid) == before + SECOND), (before, bytes_out(gw, sid))
            (gate / "go").write_text("")
            status, answer = refused.result(timeout=HANG_GUARD)
            assert status == 429, (status, answer)
            assert json.loads(answer)["reason"] == "budget_exceeded"
            upload.sendall(b"0\r\n\r\n")
            assert read_status(upload)[0] == 200
        # positive control: the upload's lease is settled (the pool goes back when its last flow ends) and
        # the same request fits exactly
        assert wait_for(lambda: bytes_out(gw, sid) == upload_head + FIRST + SECOND), bytes_out(gw, sid)
        status, answer = post(gw.proxy, auth, port, body)
        assert status == 200, (status, answer)
        assert bytes_out(gw, sid) == BUDGET
    finally:
        stop_gateway(gw)

    decisions = [
        f
        for f in iter_records(trail_files(gw.var))
        if f.record.attributes.get("egressgate.sandbox.id") == sid
        and f.record.attributes.get("egressgate.operation") == "http_request"
        and f.record.attributes.get("url.path") == "/k"
    ]
    [deny] = [f for f in decisions if f.record.attributes["egressgate.decision"] == "deny"]
    [allow] = [f for f in decisions if f.record.attributes["egressgate.decision"] == "allow"]
    attrs = deny.record.attributes
    assert (attrs["egressgate.reason"], attrs["egressgate.detail"]) == ("budget_exceeded", "outbound_bytes_max")
    assert attrs["egressgate.budget.needed"] == total
    # what the store's check read: more than the budget leaves room for (the lease that landed counts)
    assert attrs["egressgate.budget.needed"] + attrs["egressgate.budget.spent"] > BUDGET, attrs
    policies, single = load_policy_set(Path(policy_dir(gw.config)))
    for found, effect in ((deny, "deny"), (allow, "allow")):
        result = replay_records([found], policies, single)
        assert (result.replayed, result.unchanged) == (1, 1), (effect, [c.to_json() for c in result.changes])
    assert_config_replays(gw.config)  # and the whole trail: nothing flips


def policy_dir(config: Path) -> str:
    import yaml

    return yaml.safe_load(config.read_text())["policy"]
