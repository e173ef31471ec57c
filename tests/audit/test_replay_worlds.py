"""`audit replay` with the recording policy flips nothing (issue 23, item 1).

A real gateway in the loopback world makes every kind of decision the address check takes part in —
CONNECT and plain-HTTP requests whose name resolves to a forbidden address (`address_forbidden`, decided
after the rules allowed the name), a name with one allowed and one forbidden answer, loopback refused by a
policy without `allow_private`, an allowed request, a rule deny, a raw-TCP tunnel, a spent budget — and the
trail is replayed with the same policies: zero flips. Before the fix the address denials carried no
`egressgate.facts.addresses` and replayed as `address_forbidden -> rule_matched`.

Positive controls: the same trail under a policy that allows the canary's range flips exactly the address
denials of that policy (deny->allow), and removing one allow rule flips exactly its allowed records.
The other worlds (escape incl. transparent and DNS, approvals, MCP, budgets, tests/gateway's session
gateway) replay their whole trail at teardown (tests/support/replay_check.py).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from egressgate.audit.cli import audit
from egressgate.audit.find import iter_records
from egressgate.audit.replay import load_policy_set, replay_diff
from tests.support.gwworld import Gateway, World, connect_tunnel, policies
from tests.support.launcher import launch_loopback, stop_gateway, write_policies
from tests.support.replay_check import assert_replays_unchanged, trail_files


def _start(w: World, tmp: Path) -> Gateway:
    docs = policies(w)
    # plain HTTP to a name that resolves to the canary: allowed by its rule, refused by the address check
    docs["replay-http"] = {
        "sandbox": {"name": "replay-http"},
        "network": {
            "allow_private": ["127.0.0.1/32"],
            "http": {
                "allow": [
                    {"id": "canary-http", "host": "canary.test", "ports": [w.http_port]},
                    {"id": "plain", "host": "api.test", "ports": [w.http_port], "methods": ["GET"]},
                ]
            },
        },
    }
    policy_dir = write_policies(tmp / "policies", docs)
    ca_bundle = tmp / "upstream-ca.pem"
    ca_bundle.write_bytes(w.ca.cert_pem.bytes())
    config = {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
        "policy": str(policy_dir),
        "var_dir": str(tmp / "var"),
        "upstream": {"resolver": f"127.0.0.1:{w.dns_port}", "ca_bundle": str(ca_bundle)},
    }
    return Gateway(**launch_loopback(tmp, config), policy_dir=policy_dir, world=w)


def _status(head: bytes) -> int:
    return int(head.split(b" ", 2)[1])


def _traffic(gw: Gateway, w: World) -> dict[str, str]:
    """Drive the decisions; returns sandbox ids by policy."""
    basic, noprivate, tcp = gw.admit("gw-basic"), gw.admit("gw-noprivate"), gw.admit("gw-tcp")
    http_sbx, budget = gw.admit("replay-http"), gw.admit("gw-budget")
    for target, expect in (
        (f"canary.test:{w.canary_https_port}", 403),
        (f"mixed.test:{w.https_port}", 403),
        (f"127.0.0.2:{w.canary_https_port}", 403),
        (f"nothere.test:{w.https_port}", 403),
    ):
        sock, head = connect_tunnel(gw, basic, target)
        sock.close()
        assert _status(head) == expect, (target, head)
    with basic.client() as c:
        assert c.get(basic.url("api.test", "/echo")).status_code == 200
        assert c.post(basic.url("api.test", "/not-allowed"), content=b"x").status_code == 403
    sock, head = connect_tunnel(gw, noprivate, f"api.test:{w.https_port}")  # loopback: no allow_private
    sock.close()
    assert _status(head) == 403, head
    sock, head = connect_tunnel(gw, tcp, f"tcp.test:{w.tcp_port}")  # a raw-TCP tunnel (tcp rule), relayed
    try:
        assert _status(head) == 200, head
        sock.sendall(b"hello\n")
        assert sock.recv(100).startswith(b"echo:hello")
    finally:
        sock.close()
    with http_sbx.client() as c:
        assert c.get(f"http://canary.test:{w.http_port}/echo").status_code == 403
        assert c.get(f"http://api.test:{w.http_port}/echo").status_code == 200
    with budget.client() as c:
        codes = [c.post(budget.url("api.test", "/upload"), content=b"b" * 1500).status_code for _ in range(4)]
    assert 429 in codes and 200 in codes, codes
    return {"gw-basic": basic.id, "gw-noprivate": noprivate.id, "replay-http": http_sbx.id}


def test_replay_with_the_recording_policies_flips_nothing(world, tmp_path):
    gw = _start(world, tmp_path)
    try:
        ids = _traffic(gw, world)
    finally:
        assert stop_gateway(gw) == 0
    records = [f.record.attributes for f in iter_records(trail_files(gw.var))]
    address_denials = [a for a in records if a.get("egressgate.reason") == "address_forbidden"]
    # CONNECT canary.test, mixed.test, 127.0.0.2 (the engine's own literal check), api.test without
    # allow_private, plain-HTTP canary.test
    assert len(address_denials) == 5, address_denials
    for a in address_denials:  # the addresses the check read are in the record (a literal is its own host)
        assert a.get("egressgate.facts.addresses") or a["server.address"] == "127.0.0.2", a
    result = assert_replays_unchanged(gw.var, gw.policy_dir, min_replayed=10)
    assert result.skipped.get("decided outside the policy (address_forbidden)") is None

    r = CliRunner().invoke(audit, ["replay", *map(str, trail_files(gw.var)), "--policy", str(gw.policy_dir)])
    assert r.exit_code == 0, r.output
    # the console's replay-diff: raw lines, one candidate policy for one sandbox (admin/ui/audit_api.py)
    policies_now, _ = load_policy_set(gw.policy_dir)
    lines = [ln for f in trail_files(gw.var) for ln in f.read_bytes().splitlines() if ln]
    assert replay_diff(lines, policies_now) == []
    for name in ("gw-noprivate", "replay-http", "gw-basic"):
        assert replay_diff(lines, policies_now[name], sandbox=ids[name]) == [], name

    # Positive control 1: a policy that allows the canary's range flips exactly the address denials of
    # gw-noprivate / replay-http (the rules allow those names; only the address check refused them).
    for name in ("gw-noprivate", "replay-http"):
        doc = yaml.safe_load((gw.policy_dir / f"{name}.yaml").read_text())
        doc["network"]["allow_private"] = ["127.0.0.0/8"]
        (gw.policy_dir / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    # Positive control 2: without rule api-get, gw-basic's one allowed GET flips.
    doc = yaml.safe_load((gw.policy_dir / "gw-basic.yaml").read_text())
    doc["network"]["https"]["allow"] = [x for x in doc["network"]["https"]["allow"] if x["id"] != "api-get"]
    (gw.policy_dir / "gw-basic.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = CliRunner().invoke(audit, ["replay", *map(str, trail_files(gw.var)), "--policy", str(gw.policy_dir)])
    assert r.exit_code == 1, r.output
    deny_allow = [ln for ln in r.output.splitlines() if "deny->allow" in ln]
    allow_deny = [ln for ln in r.output.splitlines() if "allow->deny" in ln]
    assert len(deny_allow) == 2 and len(allow_deny) == 1, r.output
    assert any(ids["gw-noprivate"] in ln and "address_forbidden" in ln for ln in deny_allow), r.output
    assert any(ids["replay-http"] in ln and "canary.test" in ln for ln in deny_allow), r.output
    assert "/echo" in allow_deny[0] and "api-get" in allow_deny[0], r.output
