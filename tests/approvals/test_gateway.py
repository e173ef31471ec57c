"""Approvals end to end on the real gateway (loopback world): deny -> approval -> operator -> retry.

Every widening is shown with its control: the upstream sees nothing before the approval and the request
after it; the other sandbox, the other scope, the policy without network_expansion, the revoked sandbox
and the expired grant see the plain refusal (and the upstream nothing)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import jsonschema
import yaml

from tests.approvals.harness import admin, approve, connect, http_get, records
from tests.support.gwworld import Gateway
from tests.support.launcher import labels_of
from tests.support.waiting import wait_for


def asked(gw: Gateway, sbx, host: str, path: str = "/data", method: str = "GET") -> str:
    """The request is refused approval_required; returns the approval id its body names."""
    reply = http_get(gw, sbx, host, path, method)
    assert reply.status == 403 and reply.headers["x-egressgate-decision"] == "deny", reply
    body = reply.json()
    assert body["reason"] == "approval_required", body
    assert body["approval_id"].startswith("apr-") and body["approval_id"] in body["message"]
    assert "retry" in body["message"] and "\n" not in body["message"]
    return body["approval_id"]


# libyaml's safe loader when there (~10x less CPU than the pure-Python one in every worker that collects this)
APPROVAL_SCHEMA = yaml.load(
    (Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml").read_text(),
    Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader),  # noqa: S506 - a safe loader
)["components"]["schemas"]["Approval"]


def upstream_saw(gw: Gateway, mark: int, host: str) -> list[dict]:
    return [h for h in gw.world.hits.since(mark) if (h["host"] or "").startswith(host)]


def test_request_approve_retry_is_allowed_and_every_step_is_audited(gateway: Gateway):
    sbx = gateway.admit("ap-gated")
    mark = gateway.world.hits.mark()
    first = asked(gateway, sbx, "other.test")
    assert asked(gateway, sbx, "other.test", "/data") == first  # retries share one approval
    assert asked(gateway, sbx, "other.test", "/elsewhere", "POST") == first  # same sandbox and target
    assert upstream_saw(gateway, mark, "other.test") == []  # nothing went out while it waits
    shown = admin(gateway, "GET", f"/v1/approvals/{first}").json()
    assert {k: shown[k] for k in ("sandbox_id", "policy", "kind", "state", "scheme", "host", "port", "method",
                                  "path", "decided_at", "decided_by", "scope", "expires_at")} == {
        "sandbox_id": sbx.id, "policy": "ap-gated", "kind": "network_expansion", "state": "pending",
        "scheme": "http", "host": "other.test", "port": gateway.world.http_port, "method": "GET", "path": "/data",
        "decided_at": None, "decided_by": None, "scope": None, "expires_at": None}
    jsonschema.validate(shown, APPROVAL_SCHEMA)
    res = approve(gateway, first, for_seconds=600, scope="host", by="alice")
    assert res.status_code == 200, res.text
    granted = res.json()
    jsonschema.validate(granted, APPROVAL_SCHEMA)
    assert (granted["state"], granted["decided_by"], granted["scope"]) == ("approved", "alice", "host")
    assert abs(granted["expires_at"] - granted["decided_at"] - 600) < 1e-6
    assert approve(gateway, first).status_code == 409  # decided once
    ok = http_get(gateway, sbx, "other.test", "/anything?x=1", "POST")
    assert ok.status == 200, ok
    assert [h["path"] for h in upstream_saw(gateway, mark, "other.test")] == ["/anything?x=1"]
    denied_rule = http_get(gateway, sbx, "other.test", "/admin/users")  # deny rules still apply
    assert denied_rule.status == 403 and denied_rule.json()["reason"] == "denied_by_rule"
    assert len(upstream_saw(gateway, mark, "other.test")) == 1

    time.sleep(0.3)  # the requested record is written behind
    steps = records(gateway, **{"egressgate.operation": "approval", "egressgate.approval.id": first})
    assert [r["egressgate.approval.action"] for r in steps] == ["requested", "approved"]
    assert steps[1]["egressgate.approval.by"] == "alice" and steps[1]["egressgate.approval.scope"] == "host"
    assert steps[1]["egressgate.approval.expires_at"] == granted["expires_at"]
    allowed = records(gateway, **{"egressgate.operation": "http_request", "egressgate.sandbox.id": sbx.id,
                                  "egressgate.decision": "allow"})
    assert [(r["egressgate.reason"], r["egressgate.approval.id"]) for r in allowed] == [("approval_granted", first)]
    assert first in json.dumps(allowed[0]["egressgate.state.approvals"])  # what replay re-decides with
    refused = records(gateway, **{"egressgate.operation": "http_request", "egressgate.sandbox.id": sbx.id,
                                  "egressgate.reason": "approval_required"})
    assert len(refused) == 3 and {r["egressgate.approval.id"] for r in refused} == {first}
    assert {r["egressgate.detail"] for r in refused} == {"host_not_allowed"}


def approval_steps(gw: Gateway, approval_id: str, n: int) -> list[dict]:
    """The approval's `approval` records, once `n` are written (the `requested` one is written behind)."""
    def steps() -> list[dict]:
        return records(gw, **{"egressgate.operation": "approval", "egressgate.approval.id": approval_id})

    assert wait_for(lambda: len(steps()) >= n), f"fewer than {n} approval records for {approval_id}: {steps()}"
    return steps()


def test_the_explicit_proxy_settles_approvals_with_the_sandbox_labels(gateway: Gateway):
    """An approval is the sandbox's, labels included: the `requested` record the explicit proxy writes
    (for a request and for a CONNECT) carries the labels the decision read, like the operator's `approved`
    record. And the labels decide: a `when: labels` deny rule refuses the tier=locked sandbox (no approval
    offered, none lifts it), while the same request from the tier=open sandbox waits for one and is
    allowed after it (the positive control)."""
    opened = gateway.admit("ap-gated", labels={"tier": "open", "team": "a"})
    locked = gateway.admit("ap-gated", labels={"tier": "locked"})
    mark = gateway.world.hits.mark()
    first = asked(gateway, opened, "other.test", "/locked/report")
    for _ in range(2):  # before the approval and after it: the label's deny rule holds
        refused = http_get(gateway, locked, "other.test", "/locked/report")
        assert refused.status == 403 and refused.json()["reason"] == "denied_by_rule", refused
        assert refused.json()["rule"] == "locked-tier" and refused.json().get("approval_id") is None
        if _ == 0:
            assert approve(gateway, first, for_seconds=600, scope="host", by="alice").status_code == 200
    assert http_get(gateway, opened, "other.test", "/locked/report").status == 200
    assert [h["path"] for h in upstream_saw(gateway, mark, "other.test")] == ["/locked/report"]
    tunnel = connect(gateway, opened, "elsewhere.test", gateway.world.https_port)  # asked for at CONNECT
    assert tunnel.json()["reason"] == "approval_required"

    labels = {"tier": "open", "team": "a"}
    steps = approval_steps(gateway, first, 2)
    assert [(r["egressgate.approval.action"], labels_of(r)) for r in steps] == [
        ("requested", labels), ("approved", labels)]
    (at_connect,) = approval_steps(gateway, tunnel.json()["approval_id"], 1)
    assert (at_connect["egressgate.approval.action"], labels_of(at_connect)) == ("requested", labels)
    decided = records(gateway, **{"egressgate.operation": "http_request", "egressgate.sandbox.id": opened.id})
    assert [(r["egressgate.reason"], labels_of(r)) for r in decided] == [
        ("approval_required", labels), ("approval_granted", labels)]
    locked_records = records(gateway, **{"egressgate.operation": "http_request", "egressgate.sandbox.id": locked.id})
    assert {(r["egressgate.reason"], r["egressgate.rule"]) for r in locked_records} == {("denied_by_rule",
                                                                                            "locked-tier")}


def test_an_approval_for_sandbox_a_is_not_usable_by_sandbox_b(gateway: Gateway):
    a, b = gateway.admit("ap-gated"), gateway.admit("ap-gated")
    mark = gateway.world.hits.mark()
    assert approve(gateway, asked(gateway, a, "other.test"), by="alice").status_code == 200
    assert http_get(gateway, a, "other.test").status == 200  # control: A uses it
    b_id = asked(gateway, b, "other.test")  # B is still refused, with its own approval
    b_body = http_get(gateway, b, "other.test").json()
    assert b_body["approval_id"] == b_id and admin(gateway, "GET", f"/v1/approvals/{b_id}").json()["sandbox_id"] == b.id
    assert len(upstream_saw(gateway, mark, "other.test")) == 1


def test_scope_host_path_allows_one_method_on_one_path(gateway: Gateway):
    sbx = gateway.admit("ap-gated")
    mark = gateway.world.hits.mark()
    first = asked(gateway, sbx, "other.test", "/reports/q3")
    assert approve(gateway, first, scope="host+path", for_seconds=60).status_code == 200
    assert http_get(gateway, sbx, "other.test", "/reports/q3?page=2").status == 200  # query is not the path
    assert http_get(gateway, sbx, "other.test", "/reports/./q3").status == 200  # same canonical path
    second = asked(gateway, sbx, "other.test", "/reports/q4")  # another path: a new request to decide
    assert second != first
    for method, path in (("POST", "/reports/q3"), ("GET", "/reports/q3/"), ("GET", "/reports/Q3")):
        assert http_get(gateway, sbx, "other.test", path, method).json()["approval_id"] == second, (method, path)
    # forwarded as sent (decided on its canonical form, like an allow rule's paths)
    assert [h["path"] for h in upstream_saw(gateway, mark, "other.test")] == ["/reports/q3?page=2", "/reports/./q3"]


def test_connect_asks_for_the_host_and_an_approved_tunnel_is_intercepted(gateway: Gateway):
    sbx = gateway.admit("ap-gated")
    port = gateway.world.https_port
    refused = connect(gateway, sbx, "other.test", port)
    assert refused.status == 403 and refused.json()["reason"] == "approval_required"
    approval_id = refused.json()["approval_id"]
    shown = admin(gateway, "GET", f"/v1/approvals/{approval_id}").json()
    assert (shown["scheme"], shown["method"], shown["path"]) == (None, None, None)
    jsonschema.validate(shown, APPROVAL_SCHEMA)  # docs/openapi.yaml
    bad = approve(gateway, approval_id, scope="host+path")  # nothing to scope a path to
    assert bad.status_code == 400 and "scope host" in bad.json()["message"]
    assert approve(gateway, approval_id, scope="host", for_seconds=60).status_code == 200
    mark = gateway.world.hits.mark()
    with sbx.client() as c:
        r = c.get(f"https://other.test:{port}/inside")
    assert r.status_code == 200 and r.json()["path"] == "/inside"
    assert [h["path"] for h in upstream_saw(gateway, mark, "other.test")] == ["/inside"]
    with sbx.client() as c:  # deny rules inside the approved tunnel still hold
        assert c.get(f"https://other.test:{port}/admin/x").json()["reason"] == "denied_by_rule"


def test_an_approved_name_resolving_to_a_forbidden_address_is_still_refused(gateway: Gateway):
    sbx = gateway.admit("ap-gated")
    canary = gateway.world.canary.mark()
    refused = connect(gateway, sbx, "canary.test", gateway.world.canary_https_port)
    assert refused.json()["reason"] == "approval_required"
    assert approve(gateway, refused.json()["approval_id"], for_seconds=60).status_code == 200
    again = connect(gateway, sbx, "canary.test", gateway.world.canary_https_port)
    assert again.status == 403 and again.json()["reason"] == "address_forbidden"  # 127.0.0.2, not allowed_private
    # IP literals are refused before any approval is even offered
    literal = connect(gateway, sbx, "127.0.0.2", gateway.world.canary_https_port)
    assert literal.json()["reason"] == "address_forbidden" and "approval_id" not in literal.json()
    assert gateway.world.canary.since(canary) == []
    # positive control: a policy that allows 127.0.0.2 reaches the canary through the same gateway
    with gateway.admit("canary-open").client() as c:
        assert c.get(f"https://canary.test:{gateway.world.canary_https_port}/x").status_code == 200
    assert len(gateway.world.canary.since(canary)) == 1


def test_policy_without_network_expansion_gets_the_plain_default_deny(gateway: Gateway):
    sbx = gateway.admit("ap-plain")
    reply = http_get(gateway, sbx, "other.test")
    body = reply.json()
    assert reply.status == 403 and body["reason"] == "host_not_allowed" and "approval_id" not in body
    listed = admin(gateway, "GET", "/v1/approvals").json()["approvals"]
    assert [a for a in listed if a["sandbox_id"] == sbx.id] == []
    admission = gateway.admit_sandbox({"policy": "ap-plain"})  # publish/persistent_write for runtimes
    assert admission["runtime_policy"]["execution"]["require_approval_for"] == ["publish", "persistent_write"]


def test_a_revoked_sandbox_gets_nothing(gateway: Gateway):
    sbx = gateway.admit("ap-gated")
    pending = asked(gateway, sbx, "other.test")
    approved_first = gateway.admit("ap-gated")
    granted = asked(gateway, approved_first, "other.test")
    assert approve(gateway, granted).status_code == 200
    assert http_get(gateway, approved_first, "other.test").status == 200  # control
    for victim in (sbx, approved_first):
        assert gateway.revoke(victim.id).status_code == 200
    res = approve(gateway, pending)
    assert res.status_code == 409 and "revoked" in res.json()["message"]
    assert admin(gateway, "GET", f"/v1/approvals/{pending}").json()["state"] == "pending"
    mark = gateway.world.hits.mark()
    assert http_get(gateway, approved_first, "other.test").status == 407  # its live grant is worthless
    assert upstream_saw(gateway, mark, "other.test") == []


def test_operator_deny_is_final_for_retries(gateway: Gateway):
    sbx = gateway.admit("ap-gated")
    approval_id = asked(gateway, sbx, "other.test")
    res = admin(gateway, "POST", f"/v1/approvals/{approval_id}/deny", {"by": "bob"})
    assert res.status_code == 200 and res.json()["state"] == "denied" and res.json()["decided_by"] == "bob"
    body = http_get(gateway, sbx, "other.test").json()
    assert body["approval_id"] == approval_id and "denied" in body["message"]
    assert approve(gateway, approval_id).status_code == 409
    time.sleep(0.3)
    steps = records(gateway, **{"egressgate.operation": "approval", "egressgate.approval.id": approval_id})
    assert [(r["egressgate.approval.action"], r.get("egressgate.approval.by")) for r in steps] == [
        ("requested", None), ("denied", "bob")]


def test_a_sandbox_cannot_flood_the_queue(gateway: Gateway):
    sbx = gateway.admit("ap-gated")
    ids = {asked(gateway, sbx, f"h{i}.flood.test") for i in range(16)}
    assert len(ids) == 16
    over = http_get(gateway, sbx, "h16.flood.test").json()
    assert over["reason"] == "approval_required" and over["approval_id"] is None and "waiting" in over["message"]
    assert asked(gateway, sbx, "h3.flood.test") in ids  # retries of waiting ones still get their id
    other = gateway.admit("ap-gated")  # the bound is per sandbox
    assert asked(gateway, other, "h16.flood.test") not in ids
    mine = [a for a in admin(gateway, "GET", "/v1/approvals?state=pending").json()["approvals"]
            if a["sandbox_id"] == sbx.id]
    assert len(mine) == 16


def test_expiry_in_real_time(gateway: Gateway):
    sbx = gateway.admit("ap-gated", labels={"team": "expiring"})
    approval_id = asked(gateway, sbx, "other.test")
    granted = approve(gateway, approval_id, for_seconds=1).json()
    assert http_get(gateway, sbx, "other.test").status == 200
    while time.time() < granted["expires_at"] + 0.05:
        time.sleep(0.05)
    later = asked(gateway, sbx, "other.test")  # refused on time, asked anew
    assert later != approval_id
    assert admin(gateway, "GET", f"/v1/approvals/{approval_id}").json()["state"] == "expired"
    steps = approval_steps(gateway, approval_id, 3)  # requested, approved, expired (by the sweeper)
    expired = [r for r in steps if r["egressgate.approval.action"] == "expired"]
    assert len(expired) == 1 and expired[0]["egressgate.approval.expires_at"] == granted["expires_at"]
    # like the others, the sweeper's record names the sandbox's labels (the registry's)
    assert [labels_of(r) for r in steps] == [{"team": "expiring"}] * 3, steps
    listed = admin(gateway, "GET", "/v1/approvals?state=expired").json()["approvals"]
    assert approval_id in {a["id"] for a in listed}


def test_api_validates_bodies(gateway: Gateway):
    sbx = gateway.admit("ap-gated")
    approval_id = asked(gateway, sbx, "other.test")
    for body in ({"for_seconds": 0}, {"for_seconds": 86401}, {"for_seconds": True}, {"for_seconds": "10"},
                 {"scope": "path"}, {"by": ""}, {"by": "x" * 129}, {"by": 3}, {"extra": 1}):
        res = approve(gateway, approval_id, **body)
        assert res.status_code == 400 and res.json()["error"] == "invalid_request", body
    assert admin(gateway, "GET", "/v1/approvals?state=bogus").status_code == 400
    assert admin(gateway, "GET", "/v1/approvals/apr-0000").status_code == 404
    assert admin(gateway, "GET", "/v1/approvals/apr-0000").json()["error"] == "not_found"
    assert admin(gateway, "POST", "/v1/approvals/apr-0000/deny").status_code == 404
    for unknown in ("apr-0123456789abcdef", f"{approval_id}:x", "x%3Apending%3A" + sbx.id, approval_id.upper()):
        for method, suffix in (("GET", ""), ("POST", "/approve"), ("POST", "/deny")):
            res = admin(gateway, method, f"/v1/approvals/{unknown}{suffix}")
            assert res.status_code == 404 and res.json()["error"] == "not_found", (unknown, suffix)
    unauth = httpx.get(f"http://{gateway.admin}/v1/approvals", trust_env=False, timeout=10)
    assert unauth.status_code == 401
    assert admin(gateway, "GET", f"/v1/approvals/{approval_id}").json()["state"] == "pending"  # nothing applied
    no_body = httpx.post(f"http://{gateway.admin}/v1/approvals/{approval_id}/approve", trust_env=False, timeout=10,
                         headers={"Authorization": f"Bearer {gateway.token}"})
    assert no_body.status_code == 200 and no_body.json()["scope"] == "host"  # defaults: host, 600 s
    assert abs(no_body.json()["expires_at"] - no_body.json()["decided_at"] - 600) < 1e-6


def test_replay_explains_an_allow_that_an_approval_made(gateway: Gateway, tmp_path):
    from egressgate.audit.replay import format_table, replay

    sbx = gateway.admit("ap-gated")
    approval_id = asked(gateway, sbx, "other.test", "/r")
    assert approve(gateway, approval_id, by="carol").status_code == 200
    assert http_get(gateway, sbx, "other.test", "/r").status == 200
    time.sleep(0.3)
    audit = gateway.var / "audit.jsonl"
    same = replay([audit], gateway.policy_dir)  # the policy set it ran with: the approval still explains it
    assert same.by_approval.get(approval_id) == 1
    assert not [c for c in same.changes if c.sandbox_id == sbx.id]
    assert f"1 allowed by operator approval {approval_id}" in format_table(same)
    # under the same policy without network_expansion, the allow changes and the table says why it was one
    text = (gateway.policy_dir / "ap-gated.yaml").read_text()
    assert "network_expansion" in text
    plain = tmp_path / "ap-gated.yaml"
    plain.write_text(text.replace("- network_expansion\n", ""))
    changed = [c for c in replay([audit], plain).changes if c.sandbox_id == sbx.id and c.old_decision == "allow"]
    assert [(c.old_rule, c.old_reason, c.new_decision, c.new_reason) for c in changed] == [
        (f"approval {approval_id}", "approval_granted", "deny", "host_not_allowed")]


def test_an_approved_request_never_carries_a_credential(gateway: Gateway):
    sbx = gateway.admit("ap-gated")
    port = gateway.world.https_port
    mark = gateway.world.hits.mark()
    with sbx.client() as c:  # control: the credentialed rule injects its JWT
        assert c.post(f"https://api.test:{port}/keyed", content=b"x").status_code == 200
        refused = c.get(f"https://api.test:{port}/keyed")  # GET /keyed: outside the allowlist (method)
        assert refused.status_code == 403 and refused.json()["reason"] == "approval_required"
        assert approve(gateway, refused.json()["approval_id"], scope="host+path").status_code == 200
        assert c.get(f"https://api.test:{port}/keyed").status_code == 200
    injected, approved = [h for h in gateway.world.hits.since(mark) if h["path"] == "/keyed"]
    assert injected["method"] == "POST" and injected["headers"]["authorization"].startswith("Bearer ey")
    assert approved["method"] == "GET" and "authorization" not in approved["headers"]


def test_an_approval_does_not_lift_the_sandbox_byte_budget(gateway: Gateway):
    sbx = gateway.admit("ap-budget")
    port = gateway.world.https_port
    with sbx.client() as c:
        refused = c.get(f"https://api.test:{port}/other")
        assert approve(gateway, refused.json()["approval_id"]).status_code == 200
        assert c.get(f"https://api.test:{port}/other").status_code == 200  # control: approved and in budget
        over = c.post(f"https://api.test:{port}/other", content=b"x" * 4000)
        assert over.status_code == 429 and over.json()["reason"] == "budget_exceeded"


def test_cli_lists_approves_and_denies(gateway: Gateway):
    import os
    import subprocess

    from tests.support import cli as support_cli
    from tests.support.launcher import EGRESSGATE

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return support_cli.run([EGRESSGATE, "approvals", *args, "--config", str(gateway.config)], timeout=30,
                               env={**os.environ, "NO_PROXY": ""})

    sbx = gateway.admit("ap-gated")
    first, second = asked(gateway, sbx, "other.test"), asked(gateway, sbx, "h.cli.test")
    table = cli("list", "--state", "pending")
    assert table.returncode == 0 and first in table.stdout and second in table.stdout
    assert f"GET http://other.test:{gateway.world.http_port}/data" in table.stdout
    listed = json.loads(cli("list", "--format", "json").stdout)["approvals"]
    assert {first, second} <= {a["id"] for a in listed}
    bad = cli("approve", first, "--for", "2d")
    assert bad.returncode != 0 and "between 1 second and 1 day" in bad.stderr
    out = cli("approve", first, "--for", "90s", "--scope", "host+path", "--by", "dana")
    assert out.returncode == 0, out.stderr
    granted = json.loads(out.stdout)
    assert (granted["scope"], granted["decided_by"]) == ("host+path", "dana")
    assert abs(granted["expires_at"] - granted["decided_at"] - 90) < 1e-6
    denied = json.loads(cli("deny", second).stdout)
    assert denied["state"] == "denied" and denied["decided_by"]  # defaults to the login name
    again = cli("deny", second)
    assert again.returncode != 0 and "409" in again.stderr and "not_pending" in again.stderr
    assert http_get(gateway, sbx, "other.test", "/data").status == 200
