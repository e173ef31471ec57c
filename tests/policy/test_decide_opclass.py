"""decide() with operation classes: `execution.package_install` and `require_approval_for: [publish]`
enforced on requests the network rules allow (policy/decide.py step 6), with their controls: the same
request under `allow` or without `publish`, and after a grant of the right kind for the right sandbox."""

from __future__ import annotations

import json
import textwrap

from click.testing import CliRunner

from egressgate.approvals.grant import SCOPE_HOST, SCOPE_HOST_PATH, Grant
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.record import event_attributes
from egressgate.audit.replay import facts_from
from egressgate.policy.cli import policy as policy_cli
from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.reasons import Effect, Reason
from egressgate.policy.target import parse_target

NOW = 1_700_000_000.0
PEP691 = "application/vnd.pypi.simple.v1+json"


def make(package_install: str = "deny", kinds: str = "[]"):
    return parse_policy(
        textwrap.dedent(f"""
        sandbox: {{name: oc-{package_install}}}
        credentials:
          capabilities:
            reg: {{type: jwt}}
        execution:
          package_install: {package_install}
          require_approval_for: {kinds}
        network:
          https:
            deny:
              - {{id: no-admin, host: registry.example.test, paths: ["/admin/**"]}}
            allow:
              - {{id: mirror, host: mirror.example.test, methods: [GET, HEAD]}}
              - {{id: registry, host: registry.example.test, credential: reg}}
              - {{id: git, host: git.example.test}}
    """),
        f"oc-{package_install}.yaml",
    )


def state(*grants: Grant, sandbox: str = "sbx") -> SandboxState:
    return SandboxState(sandbox_id=sandbox, admitted_at=NOW - 10, approvals=grants)


def grant(
    kind: str,
    host: str,
    *,
    sandbox: str = "sbx",
    scope: str = SCOPE_HOST,
    method: str | None = None,
    path: str | None = None,
    expires: float = NOW + 60,
) -> Grant:
    return Grant(
        id=f"apr-{kind[:4]}{sandbox}",
        sandbox_id=sandbox,
        scope=scope,
        scheme="https",
        host=host,
        port=443,
        method=method,
        path=path,
        expires_at=expires,
        kind=kind,
    )


def run(policy, text: str, st: SandboxState | None = None, accept: str | None = None):
    return decide(policy, parse_target(text, accept=accept), st or state(), NOW)


WHEEL = "GET https://mirror.example.test/files/pkg-1.0-py3-none-any.whl"


def test_package_install_deny_refuses_what_the_rule_allows_and_allow_leaves_it_to_the_rules():
    denied = run(make("deny"), WHEEL)
    assert (denied.effect, denied.reason, denied.rule_id, denied.detail) == (
        Effect.DENY,
        Reason.PACKAGE_INSTALL_DENIED,
        "mirror",
        "pypi",
    )
    assert "package_install: deny" in denied.message and "\n" not in denied.message
    assert (
        run(make("deny"), "GET https://mirror.example.test/x", accept=PEP691).reason is Reason.PACKAGE_INSTALL_DENIED
    )  # PEP 691 by its Accept header
    allowed = run(make("allow"), WHEEL)  # control: same request, same rule
    assert (allowed.effect, allowed.reason, allowed.rule_id) == (Effect.ALLOW, Reason.RULE_MATCHED, "mirror")
    plain = run(make("deny"), "GET https://mirror.example.test/files/readme.txt")  # not a package: a download
    assert plain.reason is Reason.RULE_MATCHED
    assert run(make("deny"), "CONNECT mirror.example.test:443").allowed  # decided per request in the tunnel


def test_package_install_never_allows_what_the_rules_refuse():
    for mode in ("allow", "approval", "deny"):
        refused = run(make(mode), "GET https://elsewhere.example.test/simple/pkg/")
        assert refused.reason is Reason.HOST_NOT_ALLOWED, mode
        assert run(make(mode), "GET https://registry.example.test/admin/x-1.0.tar.gz").reason is Reason.DENIED_BY_RULE


def test_under_network_expansion_a_denied_install_is_not_offered_to_an_operator():
    gated = make("deny", "[network_expansion]")
    refused = run(gated, "GET https://elsewhere.example.test/simple/pkg/")
    assert (refused.reason, refused.approval_kind) == (Reason.PACKAGE_INSTALL_DENIED, None)
    other = run(gated, "GET https://elsewhere.example.test/docs")  # control: a plain request may be approved
    assert (other.reason, other.detail) == (Reason.APPROVAL_REQUIRED, "host_not_allowed")
    network = grant("network_expansion", "elsewhere.example.test")
    assert run(gated, "GET https://elsewhere.example.test/docs", state(network)).reason is Reason.APPROVAL_GRANTED
    assert (
        run(gated, "GET https://elsewhere.example.test/simple/pkg/", state(network)).reason
        is Reason.PACKAGE_INSTALL_DENIED
    )  # a network approval never lets a denied class through


def test_package_install_approval_waits_and_a_grant_of_that_kind_lets_it_through():
    policy = make("approval")
    asked = run(policy, WHEEL)
    assert (asked.reason, asked.detail, asked.approval_kind, asked.rule_id) == (
        Reason.APPROVAL_REQUIRED,
        "package_install",
        "package_install",
        "mirror",
    )
    ok = run(policy, WHEEL, state(grant("package_install", "mirror.example.test")))
    assert (ok.effect, ok.reason, ok.rule_id, ok.approval_kind) == (
        Effect.ALLOW,
        Reason.APPROVAL_GRANTED,
        "mirror",
        "package_install",
    )
    for wrong in (
        grant("publish", "mirror.example.test"),
        grant("network_expansion", "mirror.example.test"),
        grant("package_install", "other.example.test"),
        grant("package_install", "mirror.example.test", sandbox="other"),
        grant("package_install", "mirror.example.test", expires=NOW),
    ):
        assert run(policy, WHEEL, state(wrong)).reason is Reason.APPROVAL_REQUIRED, wrong


def test_publish_waits_for_approval_even_when_a_rule_allows_method_and_path():
    gated, plain = make("allow", "[publish]"), make("allow")
    npm = "PUT https://registry.example.test/pkg"
    asked = run(gated, npm)
    assert (asked.reason, asked.approval_kind, asked.rule_id) == (Reason.APPROVAL_REQUIRED, "publish", "registry")
    assert "publish (npm)" in asked.message
    control = run(plain, npm)  # not listed in require_approval_for: the rules decide
    assert (control.reason, control.capability) == (Reason.RULE_MATCHED, "reg")
    one = grant("publish", "registry.example.test", scope=SCOPE_HOST_PATH, method="PUT", path="/pkg")
    passed = run(gated, npm, state(one))
    assert (passed.reason, passed.capability, passed.approval_id) == (Reason.APPROVAL_GRANTED, "reg", one.id)
    assert run(gated, "PUT https://registry.example.test/other", state(one)).reason is Reason.APPROVAL_REQUIRED
    assert run(gated, "GET https://registry.example.test/pkg", state(one)).reason is Reason.RULE_MATCHED
    push = "GET https://git.example.test/a.git/info/refs?service=git-receive-pack"
    assert run(gated, push).approval_kind == "publish"
    assert run(gated, push.replace("receive", "upload")).reason is Reason.RULE_MATCHED  # a clone
    # a publish grant never widens the network
    wide = grant("publish", "elsewhere.example.test")
    assert run(gated, "PUT https://elsewhere.example.test/pkg", state(wide)).reason is Reason.HOST_NOT_ALLOWED


def test_audit_records_name_the_class_and_replay_reads_it_back():
    facts = parse_target("PUT https://registry.example.test/pkg")
    attrs = event_attributes(AuditEvent(kind=EventKind.HTTP_REQUEST, time_ns=1, request_id="r", facts=facts))
    assert (attrs["egressgate.operation.class"], attrs["egressgate.operation.protocol"]) == ("publish", "npm")
    assert facts_from(json.loads(json.dumps(attrs))) == facts
    plain = parse_target("GET https://registry.example.test/x")
    assert "egressgate.operation.class" not in event_attributes(
        AuditEvent(kind=EventKind.HTTP_REQUEST, time_ns=1, request_id="r", facts=plain)
    )
    forged = {**attrs, "egressgate.operation.class": "anything"}
    assert facts_from(forged).op_class is None


def test_policy_explain_says_publish(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        textwrap.dedent("""
        sandbox: {name: reg}
        execution: {package_install: approval, require_approval_for: [publish]}
        network:
          https:
            allow: [{host: registry.example.test}]
    """)
    )
    runner = CliRunner()
    out = runner.invoke(policy_cli, ["explain", "--policy", str(path), "PUT https://registry.example.test/pkg"])
    assert out.exit_code == 0, out.output
    assert "operation: publish (npm)" in out.output and "reason=approval_required" in out.output
    data = json.loads(
        runner.invoke(
            policy_cli, ["explain", "--policy", str(path), "--json", "PUT https://registry.example.test/pkg"]
        ).output
    )
    assert (data["operation"], data["protocol"], data["approval_kind"]) == ("publish", "npm", "publish")
    approved = runner.invoke(
        policy_cli, ["explain", "--policy", str(path), "--approved", "PUT https://registry.example.test/pkg"]
    )
    assert approved.output.startswith("ALLOW  reason=approval_granted"), approved.output
    index = runner.invoke(
        policy_cli,
        ["explain", "--policy", str(path), "--header", f"Accept: {PEP691}", "GET https://registry.example.test/x"],
    )
    assert "operation: package_install (pypi)" in index.output
    plain = runner.invoke(policy_cli, ["explain", "--policy", str(path), "GET https://registry.example.test/x"])
    assert "operation:" not in plain.output and plain.output.startswith("ALLOW  reason=rule_matched")
