"""End to end: a real gateway (loopback test world) writes the audit file; verify, find and replay it."""

from __future__ import annotations

import yaml
from click.testing import CliRunner
from google.protobuf.json_format import Parse
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from egressgate.audit.cli import audit
from egressgate.audit.find import iter_records
from tests.support.gwworld import start_gateway
from tests.support.launcher import stop_gateway


def test_gateway_audit_log_verifies_and_replays(world, tmp_path):
    gw = start_gateway(world, tmp_path)
    try:
        sbx = gw.admit("gw-basic", {"team": "e2e\r\ninjected"})
        with sbx.client() as c:
            ok = c.get(sbx.url("api.test", "/echo?x=1"))
            denied = c.post(sbx.url("api.test", "/not-allowed"), content=b"data")
        assert ok.status_code == 200 and denied.status_code == 403
    finally:
        assert stop_gateway(gw) == 0
    log = gw.var / "audit.jsonl"
    raw = log.read_bytes()
    assert sbx.token.encode() not in raw  # the sandbox's proxy credential never reaches the log
    for line in raw.splitlines():
        Parse(line.decode(), ExportLogsServiceRequest())

    pub = gw.var / "audit-signing.key.pub"
    r = CliRunner().invoke(audit, ["verify", "--public-key", str(pub), str(log)])
    assert r.exit_code == 0 and "sealed" in r.output, r.output

    records = [f.record.attributes for f in iter_records([log])]
    ops = [(a.get("egressgate.operation"), a.get("egressgate.decision")) for a in records]
    assert ("http_request", "allow") in ops and ("http_request", "deny") in ops
    labels = next(a["egressgate.sandbox.labels"] for a in records if "egressgate.sandbox.labels" in a)
    assert labels == {"team": "e2e\r\ninjected"}

    r = CliRunner().invoke(audit, ["replay", str(log), "--policy", str(gw.policy_dir)])
    assert r.exit_code == 0, r.output  # the same policies decide the same
    doc = yaml.safe_load((gw.policy_dir / "gw-basic.yaml").read_text())
    rules = doc["network"]["https"]["allow"]
    doc["network"]["https"]["allow"] = [x for x in rules if x["id"] != "api-get"]
    (gw.policy_dir / "gw-basic.yaml").write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(audit, ["replay", str(log), "--policy", str(gw.policy_dir)])
    assert r.exit_code == 1, r.output
    changed = [ln for ln in r.output.splitlines() if "allow->deny" in ln]
    assert len(changed) == 1 and "/echo" in changed[0] and "api-get" in changed[0], r.output
