"""An allowed HTTP request whose history cannot be written is refused before a byte goes upstream.

The gateway runs through history_fault_launcher.py: the state store's `record_request` fails (as in a
store outage) for sandboxes labelled `fault=history`. A request the history never saw would be invisible
to every later `after_request_to` / `unless_request_to` condition and request budget, so it is refused
`state_unavailable` (gateway/pipeline/enforce.py), and the refusal is audited under the allow record's request id.
Positive control: the same requests from an unlabelled sandbox of the same policy reach the upstream.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.gwworld import Gateway, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

LAUNCHER = [sys.executable, str(Path(__file__).with_name("history_fault_launcher.py"))]
FAULT = {"fault": "history"}


@pytest.fixture(scope="module")
def gw(world, tmp_path_factory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-http-history-faults")
    (tmp / "policies").mkdir()
    (tmp / "policies" / "h-faults.yaml").write_text(yaml.safe_dump({
        "sandbox": {"name": "h-faults"},
        "network": {"allow_private": ["127.0.0.1/32"],
                    "https": {"allow": [{"id": "api", "host": "api.test", "ports": [world.https_port]}]},
                    "http": {"allow": [{"id": "plain", "host": "api.test", "ports": [world.http_port]}]}},
    }))
    gateway = start_gateway(world, tmp, launcher=LAUNCHER)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


@pytest.mark.parametrize("scheme", ["https", "http"])
@pytest.mark.parametrize("labels", [FAULT, {}], ids=["history-down", "control"])
def test_request_without_history_is_refused_and_audited(gw, world, scheme, labels):
    sbx = gw.admit("h-faults", labels)
    mark = world.hits.mark()
    with sbx.client() as client:
        r = client.post(sbx.url("api.test", f"/v1/hist-{scheme}", scheme=scheme), content=b"x" * 100)
    if not labels:  # positive control: the request went through and the upstream saw it
        assert r.status_code == 200, r.text
        assert len(world.hits.since(mark)) == 1
        return
    assert r.status_code == 403 and r.json()["reason"] == "state_unavailable", r.text
    assert world.hits.since(mark) == []
    rid = r.json()["request_id"]

    def refusal() -> dict | None:
        return next((a for a in gw.audit_records() if a.get("egressgate.request.id") == rid
                     and a.get("egressgate.decision") == "deny"), None)

    assert wait_for(lambda: refusal() is not None, timeout=5)
    record = refusal()
    assert record["egressgate.reason"] == "state_unavailable"
    assert record["egressgate.rule"] == ("api" if scheme == "https" else "plain")
    # no budget was spent on a request that never left: its outcome is not an allow
    assert not any(a.get("egressgate.request.id") == rid and a.get("egressgate.operation") == "outcome"
                   for a in gw.audit_records())
