"""The console's data routes against a real gateway with real traffic through its proxy: audit search by
request hash/id/sandbox (the record read back from the JSONL, its chain position and verification), deny
stats, the request-hash calculator (the same hash the gateway recorded), policy explain, replay-diff,
learn, approvals decided from the console; every /ui response checked against docs/openapi.yaml."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from egressgate.policy.loader import parse_policy
from tests.console.apiworld import ConsoleClient
from tests.control_api.harness import APPROVE_POLICY, METRICS_POLICY, control_policies, start_control_gateway
from tests.control_api.test_openapi import SPEC, Checker, documented
from tests.support.gwworld import Gateway, World, open_world
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

# Denied by every policy here before any resolution (host_not_allowed), so never contacted; a name the
# learner may propose (not a special-use name such as .test, not resolved to loopback in the records).
DENIED_HOST = "learn-me.egressgate-console.net"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("uidworld")) as w:
        yield w


@pytest.fixture(scope="module")
def gw(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_control_gateway(world, tmp_path_factory.mktemp("uidgw"))
    try:
        yield g
    finally:
        stop_gateway(g)


@pytest.fixture(scope="module")
def operator(gw: Gateway) -> Iterator[ConsoleClient]:
    c = ConsoleClient(gw, "operator")
    yield c
    c.close()


@pytest.fixture(scope="module")
def auditor(gw: Gateway) -> Iterator[ConsoleClient]:
    c = ConsoleClient(gw, "auditor")
    yield c
    c.close()


@pytest.fixture(scope="module")
def traffic(gw: Gateway) -> dict:
    """One sandbox's allowed GET (with a query), allowed POST (with a body) and denied GET (host)."""
    sbx = gw.admit(METRICS_POLICY, {"team": "data"})
    with sbx.client() as c:
        get = c.get(sbx.url("api.test", "/v1/items"), params={"q": "ab", "n": "1"})
        post = c.post(sbx.url("api.test", "/upload"), content=b'{"k": "v"}',
                      headers={"Content-Type": "application/json"})
        denied = c.get(sbx.url(DENIED_HOST, "/not/allowed", scheme="http"))
    assert get.status_code == 200 and post.status_code == 200 and denied.status_code == 403
    return {"sbx": sbx, "denied_id": denied.json()["request_id"], "reason": denied.json()["reason"]}


def audit_of(gw: Gateway, **match) -> list[dict]:
    return [r for r in gw.audit_records() if all(r.get(k) == v for k, v in match.items())]


def attrs(record: dict) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in
            record["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]["attributes"]}


def search(client: ConsoleClient, **params) -> list[dict]:
    res = client.get("/ui/api/search", params=params)
    assert res.status_code == 200, res.text
    return res.json()["hits"]


def test_search_by_request_hash_finds_the_record_with_its_chain_position(gw, auditor, traffic):
    sbx = traffic["sbx"]
    url = sbx.url("api.test", "/v1/items") + "?q=ab&n=1"
    calc = auditor.post("/ui/api/request-hash", json={"method": "GET", "url": url})
    assert calc.status_code == 200, calc.text
    wanted = calc.json()["request_hash"]
    recorded = audit_of(gw, **{"egressgate.sandbox.id": sbx.id, "egressgate.operation": "http_request",
                               "url.path": "/v1/items"})
    assert recorded and recorded[0]["egressgate.request.hash"] == wanted  # the calculator = the gateway
    hits = search(auditor, request_hash=wanted)
    assert hits, "the record is searchable"
    for hit in hits:
        a = attrs(hit["record"])
        assert a["egressgate.request.hash"] == wanted and a["egressgate.sandbox.id"] == sbx.id
        assert hit["verified"] is True and hit["problem"] is None
        assert hit["file"].endswith("audit.jsonl") and hit["line"] >= 1 and hit["chain_index"] >= 1
        # the position is the real one: that line of that file is this record
        line = Path(hit["file"]).read_text(encoding="utf-8").splitlines()[hit["line"] - 1]
        assert attrs(json.loads(line))["egressgate.request.id"] == a["egressgate.request.id"]
    assert search(auditor, request_hash="sha256:" + "0" * 64) == []  # negative control


def test_request_hash_of_a_body_matches_the_recorded_outcome(gw, auditor, traffic):
    sbx = traffic["sbx"]
    res = auditor.post("/ui/api/request-hash", json={
        "method": "POST", "url": sbx.url("api.test", "/upload"), "headers": [["Content-Type", "application/json"]],
        "body_b64": base64.b64encode(b'{"k": "v"}').decode()})
    assert res.status_code == 200
    body = res.json()
    assert body["canonical"].startswith("egressgate-request-v1\n4:POST\n5:https\n8:api.test\n")
    decided = audit_of(gw, **{"egressgate.sandbox.id": sbx.id, "url.path": "/upload"})
    assert len(decided) == 1
    outcome = audit_of(gw, **{"egressgate.operation": "outcome",
                              "egressgate.request.id": decided[0]["egressgate.request.id"]})
    assert [r["egressgate.request.hash"] for r in outcome] == [body["request_hash"]]  # what the gateway recorded
    other = auditor.post("/ui/api/request-hash", json={
        "method": "POST", "url": sbx.url("api.test", "/upload"), "headers": [["Content-Type", "application/json"]],
        "body_b64": base64.b64encode(b'{"k": "w"}').decode()})
    assert other.json()["request_hash"] != body["request_hash"]  # the body is in the hash
    for bad in ({"method": "GET"}, {"method": "GET", "url": "ftp://x/"}, {"method": "GET", "url": "https://x/",
                                                                            "body_b64": "!!"}):
        assert auditor.post("/ui/api/request-hash", json=bad).status_code in (400, 422)


def test_search_by_request_id_sandbox_and_paging(gw, auditor, traffic):
    sbx = traffic["sbx"]
    by_id = search(auditor, request_id=traffic["denied_id"])
    assert by_id and all(attrs(h["record"])["egressgate.request.id"] == traffic["denied_id"] for h in by_id)
    assert any(attrs(h["record"]).get("egressgate.reason") == traffic["reason"] for h in by_id)
    everything = search(auditor, sandbox=sbx.id, limit=1000)
    assert len(everything) >= 4 and {attrs(h["record"])["egressgate.sandbox.id"] for h in everything} == {sbx.id}
    first = auditor.get("/ui/api/search", params={"sandbox": sbx.id, "limit": 2}).json()
    second = search(auditor, sandbox=sbx.id, limit=1000, before=first["next_before"])
    assert [h["rowid"] for h in first["hits"]] + [h["rowid"] for h in second] == [h["rowid"] for h in everything]
    assert search(auditor, host=DENIED_HOST, reason=traffic["reason"])
    for bad in ("limit=0", "limit=5000", "since=yesterday", "colour=red", "sandbox=a&sandbox=b"):
        assert auditor.get(f"/ui/api/search?{bad}").status_code == 400, bad


def test_stats_count_denies_by_reason_and_top_hosts(gw, auditor, traffic):
    res = auditor.get("/ui/api/stats", params={"bucket": 60})
    assert res.status_code == 200, res.text
    body = res.json()
    reasons: dict[str, int] = {}
    for bucket in body["buckets"]:
        for reason, n in bucket["by_reason"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    assert reasons.get(traffic["reason"], 0) >= 1
    assert DENIED_HOST in {h["host"] for h in body["top_denied_hosts"]}
    assert auditor.get("/ui/api/stats", params={"since": 10, "until": 5}).status_code == 400
    assert auditor.get("/ui/api/stats", params={"since": 0, "bucket": 1}).status_code == 400  # too many buckets


def test_explain_with_a_loaded_policy_and_a_candidate(gw, auditor, world):
    url = f"https://api.test:{world.https_port}/echo"
    res = auditor.post("/ui/api/explain", json={"policy": METRICS_POLICY, "method": "GET", "url": url})
    assert res.status_code == 200 and res.json()["decision"] == "allow" and res.json()["rule"] == "c12-get"
    res = auditor.post("/ui/api/explain", json={"policy": METRICS_POLICY, "method": "DELETE", "url": url})
    assert res.json()["decision"] == "deny" and res.json()["reason"] == "method_not_allowed" and res.json()["message"]
    candidate = yaml.safe_dump({"sandbox": {"name": "cand"}, "network": {"https": {"allow": [
        {"id": "cand-del", "host": "api.test", "ports": [world.https_port], "methods": ["DELETE"]}]}}})
    res = auditor.post("/ui/api/explain", json={"policy_yaml": candidate, "method": "DELETE", "url": url})
    assert res.json()["decision"] == "allow" and res.json()["rule"] == "cand-del" and res.json()["policy"] == "cand"
    assert res.json()["operation"] is None
    publish = url.replace("/echo", "/pkg")  # npm publish, recognised by protocol (policy/opclass.py)
    res = auditor.post("/ui/api/explain", json={"policy_yaml": candidate.replace("DELETE", "PUT"), "method": "PUT",
                                                "url": publish})
    assert (res.json()["decision"], res.json()["operation"]) == ("allow", "publish")  # no publish approval asked
    assert auditor.post("/ui/api/explain", json={"policy": "nope", "method": "GET", "url": url}).status_code == 404
    assert auditor.post("/ui/api/explain", json={"policy_yaml": "network: [", "method": "GET",
                                                 "url": url}).status_code == 422
    assert auditor.post("/ui/api/explain", json={"policy": METRICS_POLICY, "policy_yaml": candidate,
                                                 "method": "GET", "url": url}).status_code == 400


def test_replay_diff_shows_the_decisions_a_candidate_flips(gw, auditor, world, traffic):
    sbx = traffic["sbx"]
    doc = control_policies(world)[METRICS_POLICY]
    doc["network"]["https"]["allow"] = [r for r in doc["network"]["https"]["allow"] if r["id"] != "c12-get"]
    doc["network"]["http"] = {"allow": [{"id": "open-now", "host": DENIED_HOST, "ports": [world.http_port]}]}
    res = auditor.post("/ui/api/replay-diff", json={"policy_yaml": yaml.safe_dump(doc), "sandbox": sbx.id})
    assert res.status_code == 200, res.text
    flips = res.json()["flips"]
    assert any("//api.test:" in f["target"] and f["direction"] == "allow->deny" for f in flips), flips
    assert any(f"//{DENIED_HOST}:" in f["target"] and f["direction"] == "deny->allow" for f in flips), flips
    assert {f["sandbox"] for f in flips} == {sbx.id}
    same = auditor.post("/ui/api/replay-diff", json={"policy_yaml": yaml.safe_dump(
        control_policies(world)[METRICS_POLICY]), "sandbox": sbx.id})
    assert same.status_code == 200 and same.json()["flips"] == []  # positive control: the same policy flips none
    assert auditor.post("/ui/api/replay-diff", json={"policy_yaml": "x: ["}).status_code == 422


def test_learn_returns_a_yaml_attachment_that_replay_diff_confirms(gw, auditor, traffic, world):
    """What is proposed is the learner's business (egressgate/policy/learn.py and its tests); here: the
    console serves it as a downloadable policy that loads, and replay-diff of that policy over the same
    trail flips exactly the denied request into an allow."""
    sbx = traffic["sbx"]
    res = auditor.post("/ui/api/learn", json={"sandbox": sbx.id})
    assert res.status_code == 200, res.text
    assert res.headers["content-type"].startswith("application/yaml")
    assert res.headers["content-disposition"] == f'attachment; filename="learned-{sbx.id}.yaml"'
    learned = parse_policy(res.text, "<learned>")
    assert learned.name == METRICS_POLICY and sbx.id in res.text
    rules = yaml.safe_load(res.text)["network"]["http"]["allow"]
    assert [(r["host"], r["methods"], r["paths"]) for r in rules] == [(DENIED_HOST, ["GET"], ["/not/allowed"])]
    flips = auditor.post("/ui/api/replay-diff", json={"policy_yaml": res.text, "sandbox": sbx.id}).json()["flips"]
    opened = [f for f in flips if f["direction"] == "deny->allow"]
    assert len(opened) == 1 and opened[0]["request_id"] == traffic["denied_id"]
    by_labels = auditor.post("/ui/api/learn", json={"labels": {"team": "data"}})
    assert by_labels.status_code == 200 and DENIED_HOST in by_labels.text
    assert 'filename="learned-team-data.yaml"' in by_labels.headers["content-disposition"]
    assert auditor.post("/ui/api/learn", json={}).status_code == 400  # no selector
    assert auditor.post("/ui/api/learn", json={"sandbox": sbx.id}, csrf=None).status_code == 403


def test_approvals_are_decided_from_the_console_by_an_operator_only(gw, operator, auditor, world):
    sbx = gw.admit(APPROVE_POLICY)
    with sbx.client() as c:
        for host in ("other.test", "open.test"):
            assert c.get(f"http://{host}:{world.http_port}/x").json()["reason"] == "approval_required"
    assert wait_for(lambda: len([a for a in operator.get("/ui/api/approvals?state=pending").json()["approvals"]
                                 if a["sandbox_id"] == sbx.id]) == 2)
    first, second = [a["id"] for a in operator.get("/ui/api/approvals?state=pending").json()["approvals"]
                     if a["sandbox_id"] == sbx.id]
    assert auditor.post(f"/ui/api/approvals/{first}/approve", json={}).status_code == 403
    res = operator.post(f"/ui/api/approvals/{first}/approve", json={"for_seconds": 60, "scope": "host"})
    assert res.status_code == 200 and res.json()["decided_by"] == "console:operator", res.text
    assert operator.post(f"/ui/api/approvals/{first}/approve", json={"by": "mallory"}).status_code == 400
    res = operator.post(f"/ui/api/approvals/{second}/deny", json={})
    assert res.status_code == 200 and res.json()["state"] == "denied"
    assert operator.post(f"/ui/api/approvals/{second}/deny", json={}).status_code == 409


def test_every_console_route_is_served_as_documented(gw, operator, auditor, traffic, world):
    check = Checker()
    anon = ConsoleClient(gw)
    sbx = traffic["sbx"]
    url = sbx.url("api.test", "/echo")
    try:
        check(anon.http.get("/ui", follow_redirects=False), "/ui")
        check.served.add(("GET", "/ui"))  # its only answer is the redirect (checked against the spec above)
        check(anon.get("/ui/"), "/ui/")
        check(anon.get("/ui/static/app.js"), "/ui/static/{file}")
        check(anon.get("/ui/static/..%2fapi.py"), "/ui/static/{file}")
        check(anon.post("/ui/api/login", json={"token": "x" * 43}), "/ui/api/login")
        check(anon.post("/ui/api/login", json={"token": "x" * 43}, origin="http://evil.example"), "/ui/api/login")
        check(anon.post("/ui/api/login", json={"nope": 1}), "/ui/api/login")
        check(anon.get("/ui/api/session"), "/ui/api/session")
        check(anon.get("/ui/api/sandboxes"), "/ui/api/sandboxes")
        s = ConsoleClient(gw)
        check(s.post("/ui/api/login", json={"token": (gw.var / "console-auditor.token").read_text().strip()},
                     csrf=None), "/ui/api/login")
        s.csrf = s.http.get("/ui/api/session").json()["csrf"]
        check(s.get("/ui/api/session"), "/ui/api/session")
        check(s.post("/ui/api/logout"), "/ui/api/logout")
        check(s.post("/ui/api/logout"), "/ui/api/logout")
        s.close()
        check(auditor.get("/ui/api/live?decision=maybe"), "/ui/api/live")
        with auditor.http.stream("GET", "/ui/api/live") as live:
            assert live.status_code == 200 and live.headers["content-type"].startswith("text/event-stream")
            check.served.add(("GET", "/ui/api/live"))
        check(auditor.get("/ui/api/sandboxes"), "/ui/api/sandboxes")
        check(auditor.get("/ui/api/sandboxes?revoked=maybe"), "/ui/api/sandboxes")
        check(auditor.get(f"/ui/api/sandboxes/{sbx.id}"), "/ui/api/sandboxes/{sandbox_id}")
        check(auditor.get("/ui/api/sandboxes/sbx-ffffffffffffffff"), "/ui/api/sandboxes/{sandbox_id}")
        check(auditor.delete(f"/ui/api/sandboxes/{sbx.id}"), "/ui/api/sandboxes/{sandbox_id}")
        victim = gw.admit(METRICS_POLICY)
        check(operator.delete(f"/ui/api/sandboxes/{victim.id}"), "/ui/api/sandboxes/{sandbox_id}")
        check(operator.delete("/ui/api/sandboxes/sbx-ffffffffffffffff"), "/ui/api/sandboxes/{sandbox_id}")
        check(auditor.get("/ui/api/approvals"), "/ui/api/approvals")
        check(auditor.get("/ui/api/approvals?state=nonsense"), "/ui/api/approvals")
        pending = gw.admit(APPROVE_POLICY)
        with pending.client() as c:
            c.get(f"http://other.test:{world.http_port}/doc")
            c.get(f"http://open.test:{world.http_port}/doc")
        assert wait_for(lambda: len([a for a in auditor.get("/ui/api/approvals").json()["approvals"]
                                     if a["sandbox_id"] == pending.id]) == 2)
        ids = [a["id"] for a in auditor.get("/ui/api/approvals").json()["approvals"] if a["sandbox_id"] == pending.id]
        check(auditor.get(f"/ui/api/approvals/{ids[0]}"), "/ui/api/approvals/{approval_id}")
        check(auditor.get("/ui/api/approvals/apr-nope"), "/ui/api/approvals/{approval_id}")
        check(operator.post(f"/ui/api/approvals/{ids[0]}/approve", json={"for_seconds": 30}),
              "/ui/api/approvals/{approval_id}/approve")
        check(operator.post(f"/ui/api/approvals/{ids[0]}/approve", json={}), "/ui/api/approvals/{approval_id}/approve")
        check(operator.post("/ui/api/approvals/apr-nope/approve", json={}), "/ui/api/approvals/{approval_id}/approve")
        check(auditor.post(f"/ui/api/approvals/{ids[1]}/deny", json={}), "/ui/api/approvals/{approval_id}/deny")
        check(operator.post(f"/ui/api/approvals/{ids[1]}/deny", json={}), "/ui/api/approvals/{approval_id}/deny")
        check(operator.post(f"/ui/api/approvals/{ids[1]}/deny", json={}), "/ui/api/approvals/{approval_id}/deny")
        check(auditor.post("/ui/api/request-hash", json={"method": "GET", "url": url}), "/ui/api/request-hash")
        check(auditor.post("/ui/api/request-hash", json={"method": "GET", "url": "ftp://x"}), "/ui/api/request-hash")
        check(auditor.post("/ui/api/request-hash", json={"method": "GET", "url": url}, csrf=None),
              "/ui/api/request-hash")
        check(auditor.post("/ui/api/explain", json={"policy": METRICS_POLICY, "method": "GET", "url": url}),
              "/ui/api/explain")
        check(auditor.post("/ui/api/explain", json={"policy": "nope", "method": "GET", "url": url}), "/ui/api/explain")
        check(auditor.get("/ui/api/stats"), "/ui/api/stats")
        check(auditor.get("/ui/api/stats?bucket=0"), "/ui/api/stats")
        check(auditor.get("/ui/api/search", params={"sandbox": sbx.id, "limit": 3}), "/ui/api/search")
        check(auditor.get("/ui/api/search?limit=0"), "/ui/api/search")
        policy = yaml.safe_dump(control_policies(world)[METRICS_POLICY])
        check(auditor.post("/ui/api/replay-diff", json={"policy_yaml": policy, "sandbox": sbx.id}),
              "/ui/api/replay-diff")
        check(auditor.post("/ui/api/replay-diff", json={"policy_yaml": "x: ["}), "/ui/api/replay-diff")
        check(auditor.post("/ui/api/learn", json={"sandbox": sbx.id}), "/ui/api/learn")
        check(auditor.post("/ui/api/learn", json={"labels": "x"}), "/ui/api/learn")
    finally:
        anon.close()
    console_ops = {op for op in documented() if op[1] == "/ui" or op[1].startswith("/ui/")}
    assert console_ops - check.served == set(), "documented console routes never answered 2xx"
    assert SPEC["components"]["securitySchemes"]["console"]["in"] == "cookie"


def test_a_record_edited_after_indexing_is_reported_not_verified(gw, auditor):
    """Last in this module (it edits the gateway's trail): the index is derived, never trusted over the
    file - the record read back is re-checked against the hash it was indexed with."""
    sbx = gw.admit(METRICS_POLICY)
    with sbx.client() as c:
        assert c.get(sbx.url("api.test", "/v1/tamper")).status_code == 200
    assert wait_for(lambda: search(auditor, sandbox=sbx.id, host="api.test"), timeout=5)
    hit = next(h for h in search(auditor, sandbox=sbx.id) if h["kind"] == "http_request")
    assert hit["verified"] is True  # positive control: before the edit
    doc = control_policies(gw.world)[METRICS_POLICY]
    doc["network"]["https"]["allow"] = [r for r in doc["network"]["https"]["allow"] if r["id"] != "c12-get"]
    no_get = yaml.safe_dump(doc)
    before = auditor.post("/ui/api/replay-diff", json={"policy_yaml": no_get, "sandbox": sbx.id}).json()
    assert [f["direction"] for f in before["flips"]] == ["allow->deny"] and before["unverified"] == 0, before
    path = hit["file"]
    lines = Path(path).read_bytes().split(b"\n")
    line = lines[hit["line"] - 1]
    assert b"/v1/tamper" in line
    lines[hit["line"] - 1] = line.replace(b"/v1/tamper", b"/v1/TAMPER")  # same length: no size change
    with open(path, "r+b") as fh:
        fh.write(b"\n".join(lines))
    after = [h for h in search(auditor, sandbox=sbx.id) if h["rowid"] == hit["rowid"] or h["line"] == hit["line"]]
    assert after and all(h["verified"] is False for h in after), after
    assert all(h["record"] is None or "/v1/TAMPER" not in str(h["record"]) or h["verified"] is False for h in after)
    # replay-diff is fed verified records only: the edited one is left out (counted), never replayed
    replayed = auditor.post("/ui/api/replay-diff", json={"policy_yaml": no_get, "sandbox": sbx.id}).json()
    assert replayed["unverified"] >= 1 and replayed["records"] == before["records"] - 1, (before, replayed)
    assert [f["request_id"] for f in replayed["flips"]] == []
