"""A raw-TCP tunnel refused because its request history could not be written is audited as refused.

The gateway runs through history_fault_launcher.py: `record_request` fails (a store outage) for
sandboxes labelled `fault=history`. history.py then refuses the relay (`state_unavailable`), and the
client reads the deny contract; before this test, the only record of that request id was the decision
record saying `allow`, so the audit trail claimed a relay that never happened. Every refusal must be in
the trail: an outcome record under the request id of the deny body, decision `deny`, reason
`state_unavailable`, no bytes. Both explicit-proxy raw-TCP paths: a CONNECT allowed only by a
`network.tcp` rule (the relay starts at once) and a CONNECT allowed by an https rule whose bytes are not
TLS/HTTP (layers/next_layer.py's in-tunnel raw-TCP decision). Positive control: the same tunnels of an unlabelled
sandbox reach the upstream, and their outcome record says `allow` with the bytes.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from egressgate.audit.find import Found, iter_records
from egressgate.audit.record import Record
from egressgate.audit.replay import load_policy_set, replay_records
from egressgate.policy.loader import parse_policy
from tests.support.gwworld import Gateway, connect_tunnel, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.replay_check import assert_config_replays, trail_files
from tests.support.waiting import wait_for

LAUNCHER = [sys.executable, str(Path(__file__).with_name("history_fault_launcher.py"))]
FAULT = {"fault": "history"}


@pytest.fixture(scope="module")
def gw(world, tmp_path_factory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-history-audit")
    (tmp / "policies").mkdir()
    port = world.tcp_port
    (tmp / "policies" / "history-audit.yaml").write_text(yaml.safe_dump({
        "sandbox": {"name": "history-audit"},
        "network": {"allow_private": ["127.0.0.1/32"],
                    # open.test: the https rule allows the CONNECT (intercepted), the tcp rule its raw bytes
                    "https": {"allow": [{"id": "open-https", "host": "open.test", "ports": [port]}]},
                    "tcp": {"allow": [{"id": "raw", "host": "tcp.test", "ports": [port]},
                                      {"id": "open-raw", "host": "open.test", "ports": [port]}]}},
    }))
    # the in-tunnel raw-TCP decision depends on state: open-raw may relay once per sandbox (its usage)
    (tmp / "policies" / "tcp-budget.yaml").write_text(yaml.safe_dump({
        "sandbox": {"name": "tcp-budget"},
        "network": {"allow_private": ["127.0.0.1/32"],
                    "https": {"allow": [{"id": "open-https", "host": "open.test", "ports": [port]}]},
                    "tcp": {"allow": [{"id": "open-raw", "host": "open.test", "ports": [port],
                                       "budget": {"requests": 1}}]}},
    }))
    gateway = start_gateway(world, tmp, launcher=LAUNCHER)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)
    assert_config_replays(gateway.config)  # every decision of the module replays the same (issue 23, item 1)


def read_all(sock: socket.socket, timeout: float) -> bytes:
    """Until the gateway closes, or `timeout` of silence (the echo upstream never closes by itself)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


def records(gw: Gateway, sandbox_id: str, operation: str) -> list[dict]:
    return [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox_id
            and r.get("egressgate.operation") == operation]


@pytest.mark.parametrize("host", ["tcp.test", "open.test"])
@pytest.mark.parametrize("labels", [FAULT, {}])
def test_raw_tcp_refused_for_its_history_is_audited(gw, world, host, labels):
    sbx = gw.admit("history-audit", labels)
    before = len(world.hits.tcp)
    sock, head = connect_tunnel(gw, sbx, f"{host}:{world.tcp_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    with sock:
        sock.sendall(b"\x00raw payload")
        got = read_all(sock, 5 if labels else 2)
    if not labels:  # positive control: relayed, and the outcome says so
        assert got == b"echo:\x00raw payload"
        assert wait_for(lambda: records(gw, sbx.id, "outcome"), timeout=5)
        [out] = records(gw, sbx.id, "outcome")
        assert out["egressgate.decision"] == "allow" and int(out["egressgate.bytes.out"]) == 12
        return
    assert b"state_unavailable" in got and b"echo:" not in got, got
    body = json.loads(got.split(b"\r\n\r\n", 1)[1])
    assert (body["error"], body["reason"]) == ("egress_denied", "state_unavailable")
    time.sleep(0.3)
    assert not any(b"raw payload" in t for t in world.hits.tcp[before:])  # nothing went upstream
    # the refusal is in the trail, under the id the client was given
    assert wait_for(lambda: records(gw, sbx.id, "outcome"), timeout=5), "the refusal was not audited"
    [out] = records(gw, sbx.id, "outcome")
    assert out["egressgate.request.id"] == body["request_id"]
    assert (out["egressgate.decision"], out["egressgate.reason"]) == ("deny", "state_unavailable")
    assert int(out.get("egressgate.bytes.out", 0)) == 0 and int(out.get("egressgate.bytes.in", 0)) == 0
    assert out["server.address"] == host
    # and it follows the decision record of the same id (the allow the history failure overturned)
    assert [r["egressgate.request.id"] for r in records(gw, sbx.id, "connect")].count(body["request_id"]) == 1


def raw_tcp_refused(gw: Gateway, world, sbx) -> bytes:
    """A tunnel to open.test (its CONNECT allowed and intercepted by open-https) whose bytes are neither
    TLS nor HTTP: the in-tunnel raw-TCP decision (layers/next_layer.py); what the client read."""
    sock, head = connect_tunnel(gw, sbx, f"open.test:{world.tcp_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    with sock:
        sock.sendall(b"\x00raw payload")
        return read_all(sock, 5)


def without_state(found: Found, sandbox_id: str) -> Found:
    """`found` as recorded before raw-TCP tunnel records carried state: this sandbox's tcp records lose
    their `egressgate.state.*` section (replay then reconstructs the state from the log)."""
    attrs = found.record.attributes
    if attrs.get("egressgate.sandbox.id") != sandbox_id or attrs.get("url.scheme") != "tcp":
        return found
    kept = {k: v for k, v in attrs.items() if not k.startswith("egressgate.state.")}
    record = Record(found.record.time_ns, found.record.severity_number, found.record.severity_text,
                    found.record.event_name, found.record.body, kept)
    return Found(found.path, found.line, found.raw, record)


def test_raw_tcp_tunnel_records_carry_state_and_replay_unchanged(gw, world):
    """The record of an in-tunnel raw-TCP decision carries the state it was decided on (the same
    `egressgate.state.*` section as the tunnel's CONNECT record), so `audit replay` re-decides it exactly.

    Two tunnels of one sandbox, each allowed by `open-raw` (budget: 1 request) on a usage of 0: the
    history write fails (a store outage, fault=history), so the store never counted either, and both were
    refused `state_unavailable` after their allow was recorded. Replayed from the log alone, the second one
    would see the first as a use and flip to budget_exceeded (the positive control strips the state and
    shows that flip); with the recorded usage (0) nothing flips. A stricter policy (no tcp rule) still flips
    both: the records are re-decided, not skipped."""
    sbx = gw.admit("tcp-budget", FAULT)
    for _ in range(2):
        got = raw_tcp_refused(gw, world, sbx)
        assert b"state_unavailable" in got and b"echo:" not in got, got

    def tcp_decisions() -> list[dict]:
        return [r for r in records(gw, sbx.id, "connect") if r.get("url.scheme") == "tcp"]

    assert wait_for(lambda: len(tcp_decisions()) == 2), records(gw, sbx.id, "connect")
    decided = tcp_decisions()

    policies, single = load_policy_set(gw.policy_dir)
    trail = list(iter_records(trail_files(gw.var)))
    exact = replay_records(trail, policies, single, sandbox=sbx.id)
    assert exact.changes == [] and exact.replayed == 4 and exact.approximated_state == 0, exact

    tunnels = [r for r in records(gw, sbx.id, "connect") if r.get("url.scheme") != "tcp"]
    assert len(tunnels) == 2 and all(r.get("egressgate.intercept") is not False for r in tunnels), tunnels
    state_keys = {k for k in tunnels[0] if k.startswith("egressgate.state.")}
    assert "egressgate.state.rule_usage" in state_keys, tunnels[0]
    for r in decided:
        assert (r["egressgate.decision"], r["egressgate.rule"]) == ("allow", "open-raw"), r
        assert {k for k in r if k.startswith("egressgate.state.")} == state_keys, r
    usage = [f.record.attributes["egressgate.state.rule_usage"] for f in trail
             if f.record.attributes.get("egressgate.sandbox.id") == sbx.id
             and f.record.attributes.get("url.scheme") == "tcp" and f.record.attributes.get("egressgate.operation")
             == "connect"]
    assert usage == [{"open-raw": {"requests": 0, "bytes": 0}}] * 2  # each decided on 0 uses

    # positive controls: the same trail without the tcp records' state flips the second one ...
    blind = replay_records([without_state(f, sbx.id) for f in trail], policies, single, sandbox=sbx.id)
    assert [(c.direction, c.new_reason) for c in blind.changes] == [("allow->deny", "budget_exceeded")], blind
    assert blind.approximated_state == 2
    # ... and a policy without the tcp rule flips both recorded allows
    strict = parse_policy(yaml.safe_dump({
        "sandbox": {"name": "tcp-budget"},
        "network": {"allow_private": ["127.0.0.1/32"],
                    "https": {"allow": [{"id": "open-https", "host": "open.test", "ports": [world.tcp_port]}]}},
    }), "strict.yaml")
    flipped = replay_records(trail, {"tcp-budget": strict}, None, sandbox=sbx.id)
    assert [c.direction for c in flipped.changes] == ["allow->deny", "allow->deny"], flipped
