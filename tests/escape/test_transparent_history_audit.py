"""The transparent listener's raw-TCP refusal for an unwritable request history is audited.

A second gateway runs through tests/gateway/history_fault_launcher.py: `record_request` fails (a store
outage) for sandboxes labelled `fault=history`. A raw-TCP connection a tcp rule allows (198.18.1.10:2222)
is then refused (`state_unavailable`) before a byte goes upstream; its decision record (an allow) was
already durable, so the refusal must be its own record: an `outcome` with decision `deny`, reason
`state_unavailable`, under the request id the client's deny body carries. Positive control: an unlabelled
sandbox of the same policy, through the same gateway, is relayed (`RAW-ACK`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.escape.checks import requests_on
from tests.networld import World
from tests.support.http1 import read_all
from tests.support.launcher import EGRESSGATE, audit_records
from tests.support.netgateway import Gateway
from tests.support.transparent import UPSTREAM, Transparent
from tests.support.waiting import wait_for

pytestmark = pytest.mark.netns

NET = "198.18.13"
FAULTY = f"{NET}.3"
LAUNCHER = [sys.executable, str(Path(__file__).parents[1] / "gateway" / "history_fault_launcher.py")]


@pytest.fixture(scope="module")
def faulty(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway.start(world, tmp_path_factory.mktemp("gateway-history-fault"), launcher=LAUNCHER)
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def thf(world: World, faulty: Gateway) -> Iterator[Transparent]:
    t = Transparent.create(world, faulty, tag="thf", net=NET, table="egC_thist")
    try:
        yield t
    finally:
        t.close()


def admit_faulty(world: World, gw: Gateway) -> str:
    res = world.exec(world.gw, EGRESSGATE, "sandbox", "admit", "--config", str(gw.config), "--policy",
                     "escape-transparent", "--label", "fault=history", "--address", FAULTY)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["id"]


def test_transparent_raw_tcp_history_refusal_is_audited(thf: Transparent, faulty: Gateway, world: World) -> None:
    # positive control: the unlabelled sandbox (thf's own address) is relayed
    with thf.connect(UPSTREAM, 2222) as sock:
        sock.sendall(b"\x00\x01 control")
        assert read_all(sock, 1.0, first=10).startswith(b"RAW-ACK"), "control not relayed"
    sandbox_id = admit_faulty(world, faulty)
    mark = world.mark()
    with thf.connect(UPSTREAM, 2222, source=FAULTY) as sock:
        sock.sendall(b"\x00\x01 refused payload")
        got = read_all(sock, 2.0, first=10)
    assert b"state_unavailable" in got and b"RAW-ACK" not in got, got
    body = json.loads(got.split(b"\r\n\r\n", 1)[1])
    time.sleep(0.3)
    assert [h for h in world.hits(mark, listener="upstream-raw") if h["event"] == "data"] == []
    assert requests_on(world, mark, "upstream-raw") == []

    def outcomes() -> list[dict]:
        return [r for r in audit_records(faulty.tmp / "var" / "audit.jsonl")
                if r.get("egressgate.request.id") == body["request_id"]
                and r.get("egressgate.operation") == "outcome"]
    assert wait_for(outcomes, timeout=5), "the refusal was not audited"
    [out] = outcomes()
    assert (out["egressgate.decision"], out["egressgate.reason"]) == ("deny", "state_unavailable")
    assert out["egressgate.sandbox.id"] == sandbox_id and out["egressgate.mode"] == "transparent"
