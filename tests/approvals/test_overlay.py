"""The pure overlay: what a live grant may let through in decide(), and what it never can.

Every widening test has its control: the same request without the grant (or with it expired, for the
other sandbox, under a policy without network_expansion) is refused, so the grant is what decides."""

from __future__ import annotations

import ipaddress
import textwrap

import pytest

from egressgate.approvals.grant import Grant
from egressgate.policy.decide import decide
from egressgate.policy.errors import PolicyError
from egressgate.policy.facts import Facts, Operation, SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.reasons import Effect, Reason
from egressgate.policy.target import parse_target

NOW = 1_700_000_000.0
BODY = """
    network:
      https:
        allow:
          - {id: api, host: api.example.com, methods: [GET], paths: ["/v1/**"]}
          - {id: keyed, host: keyed.example.com, credential: k, when: {labels: {team: a}}}
          - id: limited
            host: limited.example.com
            budget: {requests: 1}
        deny:
          - {id: no-admin, host: new.example.com, paths: ["/admin/**"]}
          - {id: banned, host: banned.example.com}
      tcp:
        allow:
          - {id: db, host: db.example.com, ports: [5432]}
    credentials:
      capabilities:
        k: {type: jwt}
"""


def policy(name: str, kinds: str) -> object:
    text = f"sandbox: {{name: {name}}}\nexecution: {{require_approval_for: [{kinds}]}}\n" + textwrap.dedent(BODY)
    return parse_policy(text, f"{name}.yaml")


GATED = policy("gated", "network_expansion")
PLAIN = policy("plain", "publish, persistent_write")


def grant(scope: str = "host", sandbox: str = "sbx-a", host: str = "new.example.com", port: int = 443,
          scheme: str | None = "https", method: str | None = "GET", path: str | None = "/data",
          expires_at: float = NOW + 60, gid: str = "apr-1") -> Grant:
    return Grant(id=gid, sandbox_id=sandbox, scope=scope, scheme=scheme, host=host, port=port, method=method,
                 path=path, expires_at=expires_at)


def state(*grants: Grant, sandbox: str = "sbx-a", **kw) -> SandboxState:
    return SandboxState(sandbox_id=sandbox, admitted_at=NOW - 10, approvals=grants, **kw)


def run(pol, text: str, st: SandboxState, resolved=(), now: float = NOW):
    facts = parse_target(text, tuple(ipaddress.ip_address(a) for a in resolved))
    return decide(pol, facts, st, now)


def test_outside_the_allowlist_is_approval_required_with_the_allowlist_reason_as_detail():
    for text, why in (("GET https://new.example.com/data", "host_not_allowed"),
                      ("GET https://api.example.com:8443/v1/x", "port_not_allowed"),
                      ("POST https://api.example.com/v1/x", "method_not_allowed"),
                      ("GET https://api.example.com/v2/x", "path_not_allowed"),
                      ("GET http://api.example.com/v1/x", "scheme_not_allowed")):
        d = run(GATED, text, state())
        assert (d.effect, d.reason, d.detail) == (Effect.DENY, Reason.APPROVAL_REQUIRED, why), text
        assert "approv" in d.message and "retry" in d.message
        plain = run(PLAIN, text, state())  # control: no network_expansion -> the plain default deny
        assert plain.reason.value == why and plain.approval_id is None


def test_a_live_grant_allows_only_what_it_covers_and_only_for_its_sandbox():
    g = grant()
    allowed = run(GATED, "GET https://new.example.com/other/path", state(g))
    assert (allowed.effect, allowed.reason, allowed.approval_id) == (Effect.ALLOW, Reason.APPROVAL_GRANTED, "apr-1")
    assert allowed.capability is None and allowed.rule_id is None  # never a credential, never a rule's budget
    # control: the same request without the grant
    assert run(GATED, "GET https://new.example.com/other/path", state()).reason is Reason.APPROVAL_REQUIRED
    # sandbox B holding A's grant in its state (a store mix-up) still gets nothing
    assert run(GATED, "GET https://new.example.com/data", state(g, sandbox="sbx-b")).reason is Reason.APPROVAL_REQUIRED
    # other port, other host, other scheme, a sibling host
    for text in ("GET https://new.example.com:8443/data", "GET https://www.new.example.com/data",
                 "GET http://new.example.com:443/data", "GET https://new.example.com.evil.test/data"):
        assert not run(GATED, text, state(g)).allowed, text


def test_scope_host_path_is_one_method_on_one_canonical_path():
    g = grant(scope="host+path", path="/data")
    assert run(GATED, "GET https://new.example.com/data", state(g)).allowed
    assert run(GATED, "GET https://new.example.com/x/../data", state(g)).allowed  # the same canonical path
    for text in ("GET https://new.example.com/data/", "GET https://new.example.com/data/x",
                 "POST https://new.example.com/data", "GET https://new.example.com/Data",
                 "GET https://new.example.com/"):
        d = run(GATED, text, state(g))
        assert d.reason is Reason.APPROVAL_REQUIRED, text
    host_scope = grant(scope="host")  # control: scope host lets every one of them through
    assert run(GATED, "POST https://new.example.com/data/x", state(host_scope)).allowed


def test_expiry_is_exact_with_now_injected():
    g = grant(expires_at=NOW + 30)
    assert run(GATED, "GET https://new.example.com/data", state(g), now=NOW + 29.999).allowed
    assert run(GATED, "GET https://new.example.com/data", state(g), now=NOW + 30).reason is Reason.APPROVAL_REQUIRED
    assert run(GATED, "GET https://new.example.com/data", state(g), now=NOW + 3600).reason is Reason.APPROVAL_REQUIRED


def test_address_checks_deny_rules_and_budgets_still_apply():
    g_new, g_banned = grant(), grant(host="banned.example.com", gid="apr-2")
    st = state(g_new, g_banned)
    assert run(GATED, "GET https://new.example.com/data", st, resolved=["93.184.216.34"]).allowed  # control
    meta, forbidden = Reason.METADATA_ENDPOINT, Reason.ADDRESS_FORBIDDEN
    for address, reason in (("169.254.169.254", meta), ("127.0.0.1", forbidden), ("10.1.2.3", forbidden),
                            ("::ffff:169.254.169.254", meta), ("64:ff9b::a9fe:a9fe", meta), ("::1", forbidden),
                            ("100.100.100.200", meta)):
        d = run(GATED, "GET https://new.example.com/data", st, resolved=["93.184.216.34", address])
        assert d.reason is reason, address
    # a grant for the literal itself does not open it, in any spelling
    for literal in ("169.254.169.254", "2852039166", "0251.0376.0251.0376", "[::ffff:169.254.169.254]", "127.1"):
        host = parse_target(f"GET http://{literal}/", ()).host
        g = grant(host=host, port=80, scheme="http", gid="apr-lit")
        d = run(GATED, f"GET http://{literal}/", state(g))
        assert d.reason in (Reason.METADATA_ENDPOINT, Reason.ADDRESS_FORBIDDEN), literal
    assert run(GATED, "GET https://new.example.com/admin/x", st).reason is Reason.DENIED_BY_RULE
    assert run(GATED, "GET https://banned.example.com/", st).reason is Reason.DENIED_BY_RULE
    assert run(GATED, "GET https://banned.example.com/", state()).reason is Reason.DENIED_BY_RULE


def test_sandbox_byte_budget_and_rule_decisions_are_not_expandable():
    capped = parse_policy("sandbox: {name: capped, resources: {outbound_bytes_max: 100}}\n"
                          "execution: {require_approval_for: [network_expansion]}\n", "capped.yaml")
    g = grant()
    assert run(capped, "GET https://new.example.com/data", state(g)).allowed  # control
    assert run(capped, "GET https://new.example.com/data", state(g, bytes_out=100)).reason is Reason.BUDGET_EXCEEDED
    # a failed `when` is the policy's decision, not a gap in the allowlist: no approval offered or honoured
    keyed = grant(host="keyed.example.com", gid="apr-k")
    d = run(GATED, "GET https://keyed.example.com/", state(keyed))
    assert d.reason is Reason.CONDITION_FAILED and d.capability is None
    from egressgate.policy.facts import RuleUsage
    spent = state(grant(host="limited.example.com", gid="apr-l"), rule_usage={"limited": RuleUsage(requests=1)})
    assert run(GATED, "GET https://limited.example.com/", spent).reason is Reason.BUDGET_EXCEEDED


def test_connect_is_opened_intercepted_never_raw_tcp_or_passthrough():
    g = grant(scope="host+path")
    facts = Facts(operation=Operation.CONNECT, host="new.example.com", port=443)
    d = decide(GATED, facts, state(g), NOW)
    assert d.allowed and d.intercept and not d.passthrough and d.reason is Reason.APPROVAL_GRANTED
    assert decide(GATED, facts, state(), NOW).reason is Reason.APPROVAL_REQUIRED  # control
    # raw TCP is never approvable, even for a host:port a grant names
    db = grant(host="db.example.com", port=5433, scheme=None, method=None, path=None, gid="apr-db")
    tcp = Facts(operation=Operation.HTTP_REQUEST, host="db.example.com", port=5433, scheme="tcp")
    assert decide(GATED, tcp, state(db), NOW).reason is Reason.PORT_NOT_ALLOWED


def test_policy_without_network_expansion_ignores_grants():
    d = run(PLAIN, "GET https://new.example.com/data", state(grant()))
    assert d.reason is Reason.HOST_NOT_ALLOWED and not d.allowed


def test_dns_queries_never_use_grants():
    facts = Facts(operation=Operation.DNS_QUERY, host="new.example.com", scheme="dns", qtype="A")
    assert decide(GATED, facts, state(grant()), NOW).reason is Reason.HOST_NOT_ALLOWED


@pytest.mark.parametrize("bad, message", [
    ("[network_expanse]", "execution.require_approval_for[0]: unknown approval kind 'network_expanse'"),
    ("[publish, Publish]", "execution.require_approval_for[1]: unknown approval kind 'Publish'"),
    ("[publish, publish]", "execution.require_approval_for[1]: 'publish' is listed twice"),
])
def test_unknown_kinds_are_load_errors_naming_file_and_key_path(bad, message):
    with pytest.raises(PolicyError) as exc:
        parse_policy(f"sandbox: {{name: x}}\nexecution: {{require_approval_for: {bad}}}\n", "pol/x.yaml")
    assert "pol/x.yaml" in str(exc.value) and message in str(exc.value)


def test_compiled_policy_records_every_kind():
    assert GATED.approval_kinds == frozenset({"network_expansion"})
    assert PLAIN.approval_kinds == frozenset({"publish", "persistent_write"})
