"""End to end with the real gateway (`egressgate run`, loopback world): its audit file is learned from,
the output passes `policy check`, and `audit replay` flips exactly the learned denials. The world's names
resolve to 127.0.0.1, so a denial on a name the gateway *recorded* resolving there is never learned --
the refusal seen on real records, not only on hand-made ones."""

from __future__ import annotations

from click.testing import CliRunner

from egressgate.audit.find import iter_records
from egressgate.audit.replay import replay
from egressgate.policy.cli import policy
from egressgate.safeyaml import load_yaml
from tests.support.gwworld import connect_tunnel, start_gateway
from tests.support.launcher import stop_gateway


def test_learn_from_a_real_gateway_trail(world, tmp_path):
    gw = start_gateway(world, tmp_path)
    try:
        sbx = gw.admit("gw-basic", {"team": "learn"})
        other = gw.admit("gw-basic", {"team": "other"})
        with sbx.client() as c:
            assert c.get(sbx.url("api.test", "/echo")).status_code == 200  # pinned to 127.0.0.1
            assert c.post(sbx.url("api.test", "/not-allowed"), content=b"x").status_code == 403
            assert c.get(f"http://fresh.test:{world.http_port}/x").status_code == 403
        sock, head = connect_tunnel(gw, sbx, "newhost.test:443")
        sock.close()
        assert b" 403 " in head
        sock, head = connect_tunnel(gw, other, "other-sandbox.test:443")
        sock.close()
        assert b" 403 " in head
    finally:
        assert stop_gateway(gw) == 0
    log = gw.var / "audit.jsonl"
    base = gw.policy_dir / "gw-basic.yaml"
    out = tmp_path / "learned.yaml"
    run = CliRunner().invoke(policy, ["learn", str(log), "--sandbox", sbx.id, "--base", str(base), "-o", str(out)])
    assert run.exit_code == 0, run.output
    assert "not learnable 1: resolves to a loopback address" in run.stderr, run.stderr
    assert CliRunner().invoke(policy, ["check", str(out)]).exit_code == 0

    doc = load_yaml(out.read_text())
    learned = {(scheme, r["host"]): r for scheme in ("https", "http") for r in doc["network"][scheme]["allow"]
               if r["id"].startswith("learned")}
    assert learned == {
        ("https", "newhost.test"): {"id": "learned-newhost.test", "host": "newhost.test", "ports": [443]},
        ("http", "fresh.test"): {"id": "learned-fresh.test", "host": "fresh.test", "ports": [world.http_port],
                                 "methods": ["GET"], "paths": ["/x"]},
    }
    assert "other-sandbox" not in out.read_text() and "not-allowed" not in out.read_text()

    denied = {f.record.attributes["egressgate.request.id"]: f.record.attributes
              for f in iter_records([log]) if f.record.attributes.get("egressgate.decision") == "deny"}
    want = {rid for rid, a in denied.items()
            if a.get("server.address") in ("newhost.test", "fresh.test") and a["egressgate.sandbox.id"] == sbx.id}
    assert len(want) == 2
    changes = replay([log], out).changes
    assert {c.request_id: c.direction for c in changes} == dict.fromkeys(want, "deny->allow")

    # control: the same trail with the recorded addresses removed WOULD teach POST api.test/not-allowed,
    # so it is the recorded loopback resolution that keeps it out
    from egressgate.policy.learn import Selector, learn

    stripped = list(iter_records([log]))
    for f in stripped:
        for key in ("egressgate.facts.addresses", "egressgate.pinned.address", "network.peer.address"):
            f.record.attributes.pop(key, None)
    control = learn(stripped, Selector(sandbox=sbx.id), base_yaml=base.read_text())
    assert "/not-allowed" in control.policy_yaml and not control.not_learnable
