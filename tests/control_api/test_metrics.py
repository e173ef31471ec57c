"""/metrics against real traffic: requests through the real gateway move exactly the counters they should,
by exactly the expected amount, and nothing else (the audit trail of the same requests is the oracle for
the full set; explicit numbers pin the ones a reader cares about). Labels never carry what a sandbox
chooses (hosts, paths, sandbox ids)."""

from __future__ import annotations

import base64
from collections import Counter

import dns.rcode
import httpx

from tests.control_api.harness import DNS_SOURCE, METRICS_POLICY, SCRAPED_BY, api, ask, delta, scrape, value
from tests.support.waiting import wait_for

DECISIONS = "egressgate_decisions_total"


def _records(gw, start: int) -> list[dict]:
    return [r for r in gw.audit_records()[start:] if "egressgate.operation" in r]


def _settled(gw, start: int, outcomes: int) -> list[dict]:
    """The audit records since `start`, once `outcomes` outcome records have landed (written behind)."""
    assert wait_for(lambda: sum(r["egressgate.operation"] == "outcome" for r in _records(gw, start)) >= outcomes)
    return _records(gw, start)


def _expected_decisions(records: list[dict]) -> Counter:
    return Counter((r["egressgate.operation"], r.get("egressgate.decision", ""), r.get("egressgate.reason", ""),
                    r.get("egressgate.rule", "")) for r in records if r["egressgate.operation"] != "outcome")


def _decision_deltas(changes: dict) -> Counter:
    out: Counter = Counter()
    for (name, labels), n in changes.items():
        if name == DECISIONS:
            d = dict(labels)
            out[(d["operation"], d["decision"], d["reason"], d["rule"])] += int(n)
    return out


def test_http_decisions_bytes_and_durations_move_by_exactly_the_traffic(cgw):
    sbx = cgw.admit(METRICS_POLICY)
    start = len(cgw.audit_records())
    before = scrape(cgw)
    upload = b"x" * 20_000
    with sbx.client() as c:
        assert c.get(sbx.url("api.test", "/echo")).status_code == 200
        assert c.post(sbx.url("api.test", "/upload"), content=upload).status_code == 200
        denied = c.get(sbx.url("api.test", "/not-allowed"))
        assert denied.status_code == 403 and denied.json()["reason"] == "path_not_allowed"
    records = _settled(cgw, start, outcomes=2)
    after = scrape(cgw)
    changes = delta(before, after)

    # the explicit numbers
    assert value(after, DECISIONS, operation="http_request", decision="allow", reason="rule_matched",
                 rule="c12-get") - value(before, DECISIONS, operation="http_request", decision="allow",
                                         reason="rule_matched", rule="c12-get") == 1
    assert value(after, DECISIONS, operation="http_request", decision="allow", reason="rule_matched",
                 rule="c12-post") - value(before, DECISIONS, operation="http_request", decision="allow",
                                          reason="rule_matched", rule="c12-post") == 1
    denies = [k for k in changes if k[0] == DECISIONS and ("reason", "path_not_allowed") in k[1]]
    assert len(denies) == 1 and changes[denies[0]] == 1
    # ... and the whole set equals what the audit trail recorded for the same requests (nothing else moved)
    assert _decision_deltas(changes) == _expected_decisions(records)

    outcomes = [r for r in records if r["egressgate.operation"] == "outcome"]
    sent = sum(int(r.get("egressgate.bytes.out", 0)) for r in outcomes)
    received = sum(int(r.get("egressgate.bytes.in", 0)) for r in outcomes)
    assert sent >= len(upload) and received > 0
    assert changes[("egressgate_bytes_total", (("direction", "out"),))] == sent
    assert changes[("egressgate_bytes_total", (("direction", "in"),))] == received
    assert changes[("egressgate_flow_duration_seconds_count", ())] == len(outcomes) == 2
    assert changes[("egressgate_outcomes_total", (("decision", "allow"), ("reason", "rule_matched"),
                                                  ("rule", "c12-post")))] == 1


def test_nothing_moves_without_traffic_and_labels_hold_no_sandbox_input(cgw):
    sbx = cgw.admit(METRICS_POLICY, labels={"team": "c12-label-value"})
    before = scrape(cgw)
    again = scrape(cgw)
    # negative: scraping is not traffic
    assert {k for k in delta(before, again) if k[0].startswith(("egressgate_decisions", "egressgate_bytes",
                                                                 "egressgate_outcomes", "egressgate_flow"))} == set()
    with sbx.client() as c:
        r = c.get(sbx.url("api.test", "/v1/c12-secret-path-marker"))
        assert r.status_code == 200
        r = c.get(sbx.url("c12-exfil-marker.test", "/x", scheme="http"))
        assert r.status_code == 403
    text = api(cgw, "GET", "/metrics").text
    for marker in ("c12-secret-path-marker", "c12-exfil-marker", sbx.id, "c12-label-value", "api.test"):
        assert marker not in text
    after = scrape(cgw)
    deny = {"operation": "http_request", "decision": "deny", "reason": "host_not_allowed", "rule": ""}
    assert value(after, DECISIONS, **deny) - value(before, DECISIONS, **deny) == 1


def test_budget_denial_is_counted_under_its_rule(cgw):
    sbx = cgw.admit(METRICS_POLICY)
    before = scrape(cgw)
    with sbx.client() as c:
        statuses = [c.get(sbx.url("api.test", "/echo")).status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]  # c12-get: budget of 3 requests
    after = scrape(cgw)
    labels = {"operation": "http_request", "decision": "deny", "reason": "budget_exceeded", "rule": "c12-get"}
    assert value(after, DECISIONS, **labels) - value(before, DECISIONS, **labels) == 1
    allowed = {**labels, "decision": "allow", "reason": "rule_matched"}
    assert value(after, DECISIONS, **allowed) - value(before, DECISIONS, **allowed) == 3


def test_identity_failures_are_counted_without_a_rule(cgw):
    before = scrape(cgw)
    bad = "Basic " + base64.b64encode(b"sbx-0000000000000000:wrong").decode()
    res = httpx.get(f"http://api.test:{cgw.world.http_port}/x", proxy=f"http://{cgw.proxy[0]}:{cgw.proxy[1]}",
                    headers={"Proxy-Authorization": bad}, trust_env=False, timeout=10)
    assert res.status_code == 407
    changes = delta(before, scrape(cgw))
    moved = {k: n for k, n in changes.items() if k[0] == DECISIONS}
    assert list(moved.values()) == [1]
    (labels,) = [dict(k[1]) for k in moved]
    assert labels["reason"] == "identity_unknown" and labels["rule"] == "" and labels["decision"] == "deny"


def test_broker_mints_once_then_serves_from_cache(cgw):
    sbx = cgw.admit(METRICS_POLICY)
    before = scrape(cgw)
    with sbx.client() as c:
        assert c.get(sbx.url("other.test", "/echo")).status_code == 200
    middle = scrape(cgw)
    assert value(middle, "egressgate_broker_mints_total") - value(before, "egressgate_broker_mints_total") == 1
    assert value(middle, "egressgate_broker_cache_hits_total") == value(before, "egressgate_broker_cache_hits_total")
    with sbx.client() as c:
        assert c.get(sbx.url("other.test", "/echo")).status_code == 200
    after = scrape(cgw)
    assert value(after, "egressgate_broker_mints_total") == value(middle, "egressgate_broker_mints_total")
    assert value(after, "egressgate_broker_cache_hits_total") - value(middle, "egressgate_broker_cache_hits_total") == 1


def test_dns_answers_by_rcode(cgw):
    admitted = api(cgw, "POST", "/v1/sandboxes", json={"policy": METRICS_POLICY, "addresses": [DNS_SOURCE]})
    assert admitted.status_code == 201, admitted.text
    before = scrape(cgw)
    assert ask(cgw, "api.test").rcode() == dns.rcode.NOERROR
    assert ask(cgw, "c12-not-allowed.test").rcode() == dns.rcode.NXDOMAIN
    assert ask(cgw, "other.test").rcode() == dns.rcode.NOERROR
    after = scrape(cgw)
    for rcode, n in (("NOERROR", 2), ("NXDOMAIN", 1), ("SERVFAIL", 0), ("REFUSED", 0)):
        got = value(after, "egressgate_dns_answers_total", rcode=rcode) - value(
            before, "egressgate_dns_answers_total", rcode=rcode)
        assert got == n, (rcode, got)
    assert value(after, "egressgate_dns_query_duration_seconds_count") - value(
        before, "egressgate_dns_query_duration_seconds_count") == 3
    rule = {"operation": "dns_query", "decision": "allow", "reason": "rule_matched", "rule": "c12-get"}
    assert value(after, DECISIONS, **rule) - value(before, DECISIONS, **rule) == 1


def test_component_gauges_at_rest(cgw):
    samples = scrape(cgw)
    assert value(samples, "egressgate_audit_healthy") == 1
    assert value(samples, "egressgate_audit_retry_queue_depth") == 0
    assert value(samples, "egressgate_audit_write_failures_total") == 0
    assert value(samples, "egressgate_state_errors_total") == 0
    assert value(samples, "egressgate_audit_records_written_total") > 0
    workers = [dict(k[1]) for k in samples if k[0] == "egressgate_worker_info"]
    assert len(workers) == 1 and workers[0]["pid"] == str(cgw.proc.pid) and workers[0]["worker_id"]
    (labelled,) = [dict(k[1])["worker"] for k in samples if k[0] == SCRAPED_BY]
    assert labelled == workers[0]["worker_id"][:12]
    versions = [dict(k[1])["version"] for k in samples if k[0] == "egressgate_policy_set_info"]
    assert versions == [api(cgw, "GET", "/v1/policies").json()["version"]]
    raw = api(cgw, "GET", "/metrics").text  # an info metric (value 1 on a label), not a bare gauge name
    assert "# HELP egressgate_policy_set_info " in raw and "egressgate_policy_set{" not in raw


def test_metrics_need_the_admin_token(cgw):
    assert api(cgw, "GET", "/metrics", token=None).status_code == 401
    assert api(cgw, "GET", "/metrics", token="wrong-token-wrong-token").status_code == 401
    ok = api(cgw, "GET", "/metrics")
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")
