"""`tls: passthrough` in the policy language: where it may appear, what it refuses, how it decides.

A passthrough tunnel never sees a request, so every rule key that needs one (methods, paths, credential,
per-rule budget) is refused at load with its key path, and so is a passthrough rule that would carry
requests an L7 deny rule is meant to refuse. Positive controls: the same rules without `tls: passthrough`
load, and the accepted passthrough rule decides CONNECTs with `passthrough=True`.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import MappingProxyType

import pytest

from egressgate.policy.decide import decide
from egressgate.policy.errors import PolicyError
from egressgate.policy.facts import Facts, Operation, RuleUsage, SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.reasons import Reason
from egressgate.policy.target import parse_target
from egressgate.policy.testcases import tunnel_mode
from tests.support.cli import cli as support_cli

NOW = 1_700_000_000.0
STATE = SandboxState(sandbox_id="s", admitted_at=NOW - 10)
ROOT = Path(__file__).resolve().parents[2]


def policy(https: str, extra: str = "") -> str:
    return textwrap.dedent("""
        sandbox: {name: pt}
        credentials:
          capabilities:
            gh: {type: jwt}
        network:
          https:
        """) + textwrap.indent(textwrap.dedent(https), "    ") + textwrap.indent(textwrap.dedent(extra), "  ")


def load(text: str):
    return parse_policy(text, "pt.yaml")


def problems(text: str) -> dict[str, str]:
    with pytest.raises(PolicyError) as err:
        load(text)
    assert err.value.file == "pt.yaml"
    return dict(err.value.problems)


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("methods", "[GET]", "never sees the request method"),
    ("paths", '["/v1/**"]', "never sees the request path"),
    ("credential", "gh", "credentials are injected into intercepted HTTPS only"),
])
def test_l7_keys_are_refused_on_a_passthrough_rule(key, value, fragment):
    rule = f"allow:\n  - {{host: dl.example.com, {key}: {value}, tls: passthrough}}\n"
    found = problems(policy(rule))
    assert fragment in found[f"network.https.allow[0].{key}"]
    assert "tls: passthrough" in found[f"network.https.allow[0].{key}"]
    # positive control: the same rule, intercepted, is a valid rule
    assert load(policy(rule.replace(", tls: passthrough", ""))).rules[0].passthrough is False


@pytest.mark.parametrize("section", ["https", "tcp"])
def test_relayed_tunnels_budget_requests_not_bytes(section):
    """A relayed tunnel (passthrough or tcp rule) is its one request: `budget.requests` counts tunnels and
    is checked at the CONNECT; `budget.bytes` (per-rule body bytes) cannot be counted and is refused."""
    extra = ", tls: passthrough" if section == "https" else ", ports: [443]"
    text = ("sandbox: {name: pt}\nnetwork:\n  " + section + ":\n    allow:\n"
            "      - {id: r, host: dl.example.com, budget: {requests: 2, bytes: 10}" + extra + "}\n")
    assert "use budget.requests" in problems(text)[f"network.{section}.allow[0].budget.bytes"]
    compiled = load(text.replace(", bytes: 10", ""))
    connect = parse_target("CONNECT dl.example.com:443")
    for used, allowed in ((1, True), (2, False)):
        state = SandboxState(sandbox_id="s", admitted_at=NOW - 10,
                             rule_usage=MappingProxyType({"r": RuleUsage(requests=used)}))
        d = decide(compiled, connect, state, NOW)
        assert d.allowed is allowed and (allowed or d.reason is Reason.BUDGET_EXCEEDED)


def test_tls_only_on_https_allow_rules():
    found = problems(policy("deny:\n  - {host: x.example.com, tls: passthrough}\n"))
    assert "deny rules have no tls mode" in found["network.https.deny[0].tls"]
    text = ("sandbox: {name: pt}\nnetwork:\n  http:\n    allow:\n"
            "      - {host: x.example.com, tls: passthrough}\n")
    assert "network.https rules only" in problems(text)["network.http.allow[0].tls"]
    tcp = ("sandbox: {name: pt}\nnetwork:\n  tcp:\n    allow:\n"
           "      - {host: x.example.com, ports: [22], tls: passthrough}\n")
    assert "unknown key" in problems(tcp)["network.tcp.allow[0].tls"]
    bad_value = policy("allow:\n  - {host: x.example.com, tls: splice}\n")
    assert "network.https.allow[0].tls" in problems(bad_value)


@pytest.mark.parametrize("deny", [
    "{id: no-admin, host: dl.example.com, paths: ['/admin/**']}",
    "{id: no-admin, host: '*.example.com', methods: [POST]}",
    "{id: no-admin, host: '*', paths: ['/x'], ports: [443]}",
    # except_hosts that do not cover the whole passthrough host leave the overlap
    "{id: no-admin, host: '*', except_hosts: [other.example.com], methods: [POST]}",
    "{id: no-admin, host: '*', except_hosts: ['*.dl.example.com'], methods: [POST]}",
])
def test_a_passthrough_rule_cannot_hide_requests_from_an_l7_deny(deny):
    text = policy(f"deny:\n  - {deny}\nallow:\n  - {{id: dl, host: dl.example.com, tls: passthrough}}\n")
    message = problems(text)["network.https.allow[0].tls"]
    assert "'no-admin'" in message and "could not be enforced" in message
    # positive control: intercepted, the same pair of rules is valid (the deny is enforced per request)
    load(text.replace(", tls: passthrough", ""))


@pytest.mark.parametrize("deny", [
    "{id: d, host: other.example.com, paths: ['/admin/**']}",  # another host
    "{id: d, host: dl.example.com, paths: ['/admin/**'], ports: [8443]}",  # another port
    "{id: d, host: dl.example.com}",  # a whole-host deny is enforced at the CONNECT
    # the deny's except_hosts exempt the spliced host: the deny never applies to it
    "{id: d, host: '*', except_hosts: [dl.example.com], methods: [POST]}",
    "{id: d, host: '*', except_hosts: ['*.example.com'], methods: [POST]}",
])
def test_unrelated_or_connect_level_denies_are_fine(deny):
    compiled = load(policy(f"deny:\n  - {deny}\nallow:\n  - {{id: dl, host: dl.example.com, tls: passthrough}}\n"))
    assert compiled.has_passthrough


def test_a_credential_rule_behind_a_covering_passthrough_rule_is_refused():
    """The first allowing rule sets the tunnel's mode, so a credential rule after a passthrough rule that
    covers its host and ports could never inject: an error naming the credential. Controls: the same
    rules in the other order load, and so does a passthrough rule that does not cover it."""
    later = policy("""
        allow:
          - {id: dl, host: "*.example.com", tls: passthrough}
          - {id: api, host: api.example.com, credential: gh}
        """)
    message = problems(later)["network.https.allow[1].credential"]
    assert "'dl'" in message and "never be injected" in message
    load(policy("""
        allow:
          - {id: api, host: api.example.com, credential: gh}
          - {id: dl, host: "*.example.com", tls: passthrough}
        """))
    for narrower in ('except_hosts: [api.example.com]', 'when: {labels: {team: dl}}', 'ports: [8443]'):
        load(policy(f"""
        allow:
          - {{id: dl, host: "*.example.com", tls: passthrough, {narrower}}}
          - {{id: api, host: api.example.com, credential: gh}}
        """))


def test_connect_decision_carries_the_tunnel_mode():
    compiled = load(policy("""
        allow:
          - {id: api, host: api.example.com, credential: gh}
          - {id: dl, host: "*.example.com", tls: passthrough, ports: [443, 8443]}
          - {id: plain, host: plain.example.com, tls: intercept}
        """, """
          tcp:
            allow:
              - {id: ssh, host: git.example.org, ports: [22]}
        """))
    def connect(target: str):
        return decide(compiled, parse_target(f"CONNECT {target}"), STATE, NOW)

    d = connect("objects.example.com:443")
    assert (d.allowed, d.rule_id, d.passthrough, d.intercept) == (True, "dl", True, False)
    assert tunnel_mode(d) == "passthrough"
    assert connect("objects.example.com:8443").passthrough
    # the first allowing rule sets the mode: api.example.com is intercepted (credential), not spliced
    d = connect("api.example.com:443")
    assert (d.rule_id, d.passthrough, d.intercept) == ("api", False, True)
    assert tunnel_mode(connect("plain.example.com:443")) == "passthrough"  # *.example.com comes first
    assert tunnel_mode(connect("git.example.org:22")) == "tcp"
    denied = connect("objects.example.com:9443")
    assert (denied.allowed, denied.reason, tunnel_mode(denied)) == (False, Reason.PORT_NOT_ALLOWED, None)
    # per request (inside an intercepted tunnel) a passthrough rule is an ordinary allow rule
    req = decide(compiled, Facts(Operation.HTTP_REQUEST, "x.example.com", 443, "https", "GET", "/"), STATE, NOW)
    assert req.allowed and req.rule_id == "dl" and not req.passthrough


def test_policy_cli_check_explain_and_test_know_passthrough(tmp_path):
    pol = tmp_path / "pt.yaml"
    pol.write_text(policy("allow:\n  - {id: dl, host: dl.example.com, tls: passthrough}\n"
                          "  - {id: api, host: api.example.com}\n"))

    def cli(*args: str):
        return support_cli("policy", *args)

    out = cli("check", str(pol))
    assert out.returncode == 0 and "2 rules, 1 tls: passthrough" in out.stdout, out
    out = cli("explain", "--policy", str(pol), "CONNECT dl.example.com:443")
    assert out.returncode == 0 and "tunnel: passthrough" in out.stdout, out
    data = json.loads(cli("explain", "--policy", str(pol), "--json", "CONNECT api.example.com:443").stdout)
    assert data["tunnel"] == "intercept"
    cases = tmp_path / "cases.yaml"
    cases.write_text("policy: pt.yaml\ncases:\n"
                     "  - {request: 'CONNECT dl.example.com:443', expect: allow, tunnel: passthrough}\n"
                     "  - {request: 'CONNECT api.example.com:443', expect: allow, tunnel: passthrough}\n")
    out = cli("test", str(cases))
    assert out.returncode == 1, out
    assert "PASS" in out.stdout and "expected tunnel passthrough, got intercept" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(policy("allow:\n  - {id: dl, host: dl.example.com, tls: passthrough, methods: [GET]}\n"))
    out = cli("check", str(bad))
    assert out.returncode == 2 and f"{bad}: network.https.allow[0].methods:" in out.stderr
