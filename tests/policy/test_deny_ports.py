"""Issue 9 item 6 (ports): a deny rule without `ports` covers EVERY port.

Before: a deny rule without `ports` got the scheme's default port (443 / 80), so `deny host X` still let
an allow rule for X:8443 through. An allow rule without `ports` still opens only the default port
(opening stays explicit). Positive controls: a deny rule that names its ports covers only those, and
the allow rule on the other port does allow.
"""

from __future__ import annotations

import textwrap

import pytest

from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.reasons import Reason
from egressgate.policy.target import parse_target

POLICY = parse_policy(textwrap.dedent("""
    sandbox: {name: deny-ports}
    network:
      https:
        deny:
          - {id: no-api, host: api.example.com}
          - {id: no-admin, host: app.example.com, paths: ["/admin/**"]}
          - {id: no-post, host: "*.svc.example", methods: [POST]}
          - {id: no-443-only, host: scoped.example.com, ports: [443]}
        allow:
          - {id: api-alt, host: api.example.com, ports: [443, 8443, 9443]}
          - {id: app-alt, host: app.example.com, ports: [443, 8443]}
          - {id: svc-alt, host: "*.svc.example", ports: [8443]}
          - {id: scoped-alt, host: scoped.example.com, ports: [443, 8443]}
          - {id: plain-default, host: default.example.com}
      http:
        deny:
          - {id: no-http-admin, host: app.example.com, paths: ["/admin/**"]}
        allow:
          - {id: app-http, host: app.example.com, ports: [80, 8080]}
"""), "deny-ports.yaml")


def run(text: str):
    return decide(POLICY, parse_target(text, ()), SandboxState("sbx", 0.0), 1.0)


@pytest.mark.parametrize(
    ("text", "reason", "rule"),
    [
        ("GET https://api.example.com/", Reason.DENIED_BY_RULE, "no-api"),
        ("GET https://api.example.com:8443/", Reason.DENIED_BY_RULE, "no-api"),
        ("GET https://api.example.com:9443/", Reason.DENIED_BY_RULE, "no-api"),
        ("CONNECT api.example.com:8443", Reason.DENIED_BY_RULE, "no-api"),
        ("GET https://app.example.com:8443/admin/users", Reason.DENIED_BY_RULE, "no-admin"),
        ("POST https://a.svc.example:8443/x", Reason.DENIED_BY_RULE, "no-post"),
        ("GET http://app.example.com:8080/admin/", Reason.DENIED_BY_RULE, "no-http-admin"),
        # positive controls: the other paths/methods on the non-default port are allowed ...
        ("GET https://app.example.com:8443/public", Reason.RULE_MATCHED, "app-alt"),
        ("GET https://a.svc.example:8443/x", Reason.RULE_MATCHED, "svc-alt"),
        ("GET http://app.example.com:8080/public", Reason.RULE_MATCHED, "app-http"),
        # ... a deny rule that names its ports covers only them ...
        ("GET https://scoped.example.com/", Reason.DENIED_BY_RULE, "no-443-only"),
        ("GET https://scoped.example.com:8443/", Reason.RULE_MATCHED, "scoped-alt"),
        # ... and an allow rule without ports still opens only the default port.
        ("GET https://default.example.com/", Reason.RULE_MATCHED, "plain-default"),
        ("GET https://default.example.com:8443/", Reason.PORT_NOT_ALLOWED, "plain-default"),
    ],
)
def test_deny_rule_without_ports_covers_every_port(text: str, reason: Reason, rule: str) -> None:
    decision = run(text)
    assert (decision.reason, decision.rule_id) == (reason, rule), decision


def test_port_message_lists_only_allow_ports() -> None:
    decision = run("GET https://default.example.com:8443/")
    assert "allowed ports: 443." in decision.message, decision.message
