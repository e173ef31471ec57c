"""The audit observer runs for every record on the request path: it must take no lock and format no
string (the module's promise). Checked by profiling the C calls one `observe` makes, on real events built
the way the gateway builds them: a lock (its __enter__/__exit__) or str.format would show up; `%` and
f-strings are opcodes the profiler cannot see (the module has none on that path: read it)."""

from __future__ import annotations

import sys

from egressgate.admin.metrics import AuditMetrics
from egressgate.audit.build import build
from egressgate.audit.event import EventKind
from egressgate.gateway.shared.context import PolicyHolder
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Effect, Reason

ALLOWED_C_CALLS = {"get", "bisect_left", "setprofile"}  # dict.get, the bucket search, the profiler off


def _c_calls(fn) -> list[str]:
    calls: list[str] = []

    def profile(_frame, event, arg):
        if event == "c_call":
            calls.append(getattr(arg, "__name__", repr(arg)))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_observe_takes_no_lock_and_formats_nothing():
    metrics = AuditMetrics(PolicyHolder({}))
    deny = build(EventKind.HTTP_REQUEST, verdict=Decision(effect=Effect.DENY, reason=Reason.PATH_NOT_ALLOWED),
                 host="api.test", path="/x")
    outcome = build(EventKind.OUTCOME, decision="allow", reason="rule_matched", bytes_out=10, bytes_in=20,
                    duration_ms=3.5)
    dns = build(EventKind.DNS_QUERY, decision="allow", reason="rule_matched", duration_ms=0.2,
                extra={"egressgate.dns.rcode": "NOERROR"})
    for event in (deny, outcome, dns):
        metrics.observe(event)  # warm: first-time paths (none today) do not count
        calls = _c_calls(lambda e=event: metrics.observe(e))
        assert set(calls) <= ALLOWED_C_CALLS, (event.kind, calls)
    assert metrics.bytes_out == 20 and metrics.bytes_in == 40
    assert metrics.dns_rcodes == {"NOERROR": 2}


def test_positive_control_a_lock_would_be_seen():
    """The profiler sees a lock taken inside observe (what prometheus-client's Counter.inc does)."""
    import threading

    lock = threading.Lock()

    def locked() -> None:
        with lock:
            pass

    assert "__exit__" in _c_calls(locked)
    assert "format" in _c_calls(lambda: "{}".format(1))  # noqa: UP032 - str.format on purpose (% and f-strings are opcodes)


def test_rule_label_is_bounded_to_known_rule_ids():
    metrics = AuditMetrics(PolicyHolder({}))
    metrics.observe(build(EventKind.HTTP_REQUEST, decision="allow", reason="rule_matched",
                          rule_id="approval:made-up-by-someone"))
    metrics.observe(build(EventKind.HTTP_REQUEST, decision="deny", reason="not-a-reason-code"))
    assert set(metrics.decisions) == {(EventKind.HTTP_REQUEST, "allow", "rule_matched", "other"),
                                      (EventKind.HTTP_REQUEST, "deny", "other", None)}


MCP_POLICY = """
sandbox: {name: m}
network:
  https:
    allow: [{host: tickets.test, ports: [443], paths: ["/mcp"], methods: [POST]}]
mcp:
  servers:
    - name: tickets
      url: https://tickets.test/mcp
      tools:
        allow:
          - {name: search, unlisted_arguments: allow}
          - {name: close, id: tickets-close, unlisted_arguments: allow}
        deny: [drop]
"""


def test_mcp_tool_rule_ids_are_label_values_and_others_stay_bounded():
    from egressgate.admin.metrics import rule_ids
    from egressgate.policy.loader import parse_policy

    policy = parse_policy(MCP_POLICY, "m.yaml")
    ids = rule_ids({"m": policy})
    denied = next(iter(policy.mcp.servers["tickets"].denied.values()))
    assert {"mcp:tickets/search", "tickets-close", denied} <= ids
    metrics = AuditMetrics(PolicyHolder({"m": policy}))
    metrics.observe(build(EventKind.MCP_TOOL_CALL, decision="allow", reason="rule_matched", rule_id="tickets-close"))
    metrics.observe(build(EventKind.MCP_TOOL_CALL, decision="allow", reason="rule_matched", rule_id="mcp:tickets/x"))
    assert set(metrics.decisions) == {(EventKind.MCP_TOOL_CALL, "allow", "rule_matched", "tickets-close"),
                                      (EventKind.MCP_TOOL_CALL, "allow", "rule_matched", "other")}
