"""`egressgate policy learn` end to end over a real audit file: the output passes `policy check`, and
`audit replay --policy OUT` flips exactly the learned denials to allow -- nothing else, in any sandbox."""

from __future__ import annotations

import textwrap

import pytest
from click.testing import CliRunner

from egressgate.audit.cli import audit
from egressgate.audit.replay import replay, replay_diff
from egressgate.policy.cli import policy
from egressgate.policy.loader import parse_policy
from egressgate.safeyaml import load_yaml
from tests.policy_learn.conftest import Session, lines

BASE = textwrap.dedent("""\
    sandbox: {name: agent}
    execution: {package_install: allow}  # /simple/a/ below is a package index request (docs/policy.md)
    network:
      allow_private: [10.0.0.0/8]
      https:
        allow:
          - {id: gh-read, host: api.github.com, methods: [GET], paths: ["/repos/**"]}
          - {id: upload, host: uploads.example.com, methods: [PUT], paths: [/v1/a], when: {within_seconds: 100}}
          - {id: llm, host: api.openai.com, methods: [POST], paths: [/v1/responses], budget: {requests: 1}}
        deny:
          - {id: no-admin, host: api.github.com, paths: ["/admin/**"]}
    """)


def _session() -> tuple[Session, set[str], set[str]]:
    """(session, request ids a --sandbox s1 learn must flip, request ids it must never flip)."""
    s = Session(BASE)
    s.admit("s1", {"team": "a"})
    s.admit("s2", {"team": "b"})
    learn, keep = set(), set()

    def want(event, learnable: bool) -> None:
        assert event.decision == "deny", (event.host, event.path, event.reason)
        (learn if learnable else keep).add(event.request_id)

    assert s.request("s1", "GET https://api.github.com/repos/x/y").decision == "allow"
    want(s.request("s1", "POST https://api.github.com/repos/x/y/issues"), True)  # method_not_allowed
    want(s.dns("s1", "pypi.org"), True)  # covered by the learned pypi.org rule
    for path in ("/simple/a/", "/pkg/1", "/pkg/2", "/pkg/3"):
        want(s.request("s1", f"GET https://pypi.org{path}"), True)
    want(s.connect("s1", "cdn.example.net"), True)  # CONNECT only
    want(s.request("s1", "GET http://plain.example.org/x"), True)
    want(s.dns("s1", "only-dns.example.org"), True)
    # not learnable: a condition, a budget, a deny rule, private and metadata addresses, outside the engine
    want(s.request("s1", "PUT https://uploads.example.com/v1/a", at=200), False)  # condition_failed
    for i, path in enumerate(("/v1/b", "/v1/c", "/v1/d")):  # path_not_allowed: /v1/* would also open /v1/a
        want(s.request("s1", f"PUT https://uploads.example.com{path}", at=201 + i), True)
    assert s.request("s1", "POST https://api.openai.com/v1/responses").decision == "allow"
    want(s.request("s1", "POST https://api.openai.com/v1/responses"), False)  # budget_exceeded
    want(s.request("s1", "GET https://api.github.com/admin/x"), False)  # denied_by_rule
    want(s.request("s1", "GET https://10.1.2.3/x"), False)  # host_not_allowed, but a private address
    want(s.request("s1", "GET https://169.254.169.254/latest/meta-data"), False)  # metadata_endpoint
    want(s.recorded("s1", "sandbox_revoked", host="revoked.example.com", port=443, scheme="https", method="GET",
                    path="/r"), False)
    want(s.recorded("s1", "invalid_request", host="bad.example.com", port=443, scheme="https", method="GET",
                    path="/b"), False)
    # another sandbox: never learned from, and its requests are to other targets
    want(s.request("s2", "GET https://secret-s2.example.com/s2-only-path"), False)
    want(s.request("s2", "POST https://api.github.com/repos/s2/private"), False)
    want(s.recorded(None, "identity_unknown", host="pypi.org", port=443, scheme="https", method="GET",
                    path="/pkg/1"), False)
    return s, learn, keep


@pytest.fixture
async def recorded(tmp_path, signer):
    s, learn, keep = _session()
    path = await s.write(tmp_path / "audit" / "audit.jsonl", signer)
    (tmp_path / "base.yaml").write_text(BASE)
    return s, path, learn, keep


def _flipped_ids(changes) -> dict[str, str]:
    changes = getattr(changes, "changes", changes)
    assert all(c.request_id for c in changes)
    return {c.request_id: c.direction for c in changes}


async def test_learned_policy_checks_and_flips_exactly_the_learned_denials(recorded, tmp_path):
    _session, audit_file, learn, keep = recorded
    out = tmp_path / "learned.yaml"
    run = CliRunner().invoke(policy, ["learn", str(audit_file), "--sandbox", "s1", "--base",
                                      str(tmp_path / "base.yaml"), "-o", str(out)])
    assert run.exit_code == 0, run.output
    assert "not learnable" in run.stderr and "private address" in run.stderr
    check = CliRunner().invoke(policy, ["check", str(out)])
    assert check.exit_code == 0 and check.output.startswith("ok  agent"), check.output

    result = replay([audit_file], out)
    flipped = _flipped_ids(result)
    assert flipped == dict.fromkeys(learn, "deny->allow")  # every learned denial, and nothing else
    assert not (set(flipped) & keep)
    # the CLI an auditor runs says the same (exit 1: decisions change)
    table = CliRunner().invoke(audit, ["replay", str(audit_file), "--policy", str(out)])
    assert table.exit_code == 1 and f"{len(learn)} changed" in table.output

    text = out.read_text()
    doc = load_yaml(text)
    assert doc["network"]["https"]["deny"] == load_yaml(BASE)["network"]["https"]["deny"]  # base kept
    rules = {r["id"]: r for r in doc["network"]["https"]["allow"]}
    assert {"gh-read", "upload", "llm"} <= set(rules)
    assert rules["learned-pypi.org"]["paths"] == ["/pkg/*", "/simple/a/"]
    # /v1/* was narrowed: it would also have allowed the condition_failed PUT /v1/a
    assert rules["learned-uploads.example.com"]["paths"] == ["/v1/b", "/v1/c", "/v1/d"]
    assert rules["learned-api.github.com"] == {"id": "learned-api.github.com", "host": "api.github.com",
                                               "ports": [443], "methods": ["POST"], "paths": ["/repos/x/y/issues"]}
    assert rules["learned-cdn.example.net"] == {"id": "learned-cdn.example.net", "host": "cdn.example.net",
                                                "ports": [443]}
    assert doc["network"]["http"]["allow"][0]["host"] == "plain.example.org"
    assert doc["network"]["dns"]["allow"] == ["only-dns.example.org"]
    for forbidden in ("10.1.2.3", "169.254.169.254", "secret-s2", "s2-only-path", "/repos/s2", "revoked.",
                      "bad.example.com", "credential"):
        assert forbidden not in text
    assert all("credential" not in r and "when" not in r for r in rules.values() if r["id"].startswith("learned"))


async def test_the_narrowing_is_what_keeps_a_condition_denial_closed(recorded):
    """Positive control: the glob the learner refused would have flipped the condition_failed record."""
    session, _audit_file, _learn, _keep = recorded
    wide = BASE.replace("    deny:", "      - {id: wide, host: uploads.example.com, methods: [PUT], "
                                     "paths: [\"/v1/*\"]}\n    deny:")
    flips = replay_diff(session.records(), parse_policy(wide, "wide.yaml"))
    condition = next(e for e in session.events if e.reason == "condition_failed")
    assert condition.request_id in {f.request_id for f in flips}


async def test_label_selector_learns_conditional_rules_and_nothing_of_other_sandboxes(recorded, tmp_path):
    session, audit_file, learn, _keep = recorded
    run = CliRunner().invoke(policy, ["learn", str(audit_file), "--label", "team=a", "--base",
                                      str(tmp_path / "base.yaml")])
    assert run.exit_code == 0, run.output
    text = run.stdout
    doc = load_yaml(text)
    learned = [r for r in doc["network"]["https"]["allow"] if r["id"].startswith("learned")]
    assert learned and all(r["when"] == {"labels": {"team": "a"}} for r in learned)
    assert "secret-s2" not in text and "/repos/s2" not in text
    expected = dict.fromkeys(learn, "deny->allow")
    assert _flipped_ids(replay_diff(session.records(), parse_policy(text, "x"))) == expected
    assert _flipped_ids(replay([audit_file], _write(tmp_path / "l.yaml", text))) == expected
    # the other label learns only the other sandbox's traffic
    other = CliRunner().invoke(policy, ["learn", str(audit_file), "--label", "team=b"])
    assert other.exit_code == 0
    hosts = {r["host"] for r in load_yaml(other.stdout)["network"]["https"]["allow"]}
    assert hosts == {"secret-s2.example.com", "api.github.com"}
    assert "pypi" not in other.stdout


def _write(path, text):
    path.write_text(text)
    return path


def test_usage_errors(tmp_path):
    audit_file = _write(tmp_path / "a.jsonl", "")
    run = CliRunner().invoke(policy, ["learn", str(audit_file)])
    assert run.exit_code == 2 and "sandbox id or at least one label" in run.output
    bad = _write(tmp_path / "bad.yaml", "sandbox: {name: x}\nnetwork: {https: {allow: [{host: '*'}]}}\n")
    run = CliRunner().invoke(policy, ["learn", str(audit_file), "--sandbox", "s", "--base", str(bad)])
    assert run.exit_code == 2 and "bad.yaml" in run.stderr


async def test_nothing_selected_or_nothing_learnable(recorded, tmp_path):
    _session, audit_file, _learn, _keep = recorded
    out = tmp_path / "none.yaml"
    run = CliRunner().invoke(policy, ["learn", str(audit_file), "--sandbox", "no-such-sandbox", "-o", str(out)])
    assert run.exit_code == 1 and "no record of the selected sandboxes" in run.stderr and not out.exists()
    # a sandbox with only allowed traffic: the base comes back unchanged (same policy hash), exit 0
    ok = Session(BASE)
    ok.admit("s3")
    ok.request("s3", "GET https://api.github.com/repos/a")
    lines_path = _write(tmp_path / "ok.jsonl", b"\n".join(lines(ok)).decode() + "\n")
    run = CliRunner().invoke(policy, ["learn", str(lines_path), "--sandbox", "s3", "--base",
                                      str(tmp_path / "base.yaml"), "-o", str(out)])
    assert run.exit_code == 0 and "0 rules learned from 0 of 0 denied" in run.stderr
    assert parse_policy(out.read_text(), "out").hash == parse_policy(BASE, "base").hash


def test_a_base_that_does_not_load_is_reported_against_the_base():
    from egressgate.policy.errors import PolicyError
    from egressgate.policy.learn import Selector, learn

    s = Session(BASE)
    s.admit("s1")
    s.request("s1", "GET https://new.example.com/x")
    for bad in ("sandbox: {name: x}\nnetwork: {https: {allow: [{host: '*'}]}}\n",  # compile error
                "sandbox: {name: x}\nnetwork: {https: [1]}\n",  # schema error
                "sandbox: {name: x\n"):  # YAML error
        with pytest.raises(PolicyError) as exc:
            learn(lines(s), Selector(sandbox="s1"), base_yaml=bad, base_source="team/base.yaml")
        assert str(exc.value).startswith("team/base.yaml"), str(exc.value)


def test_approval_required_denials_are_learned():
    """`approval_required` is "outside the allowlist, an operator may approve": learnable like host_not_allowed."""
    from egressgate.policy.learn import Selector, learn

    gated = BASE.replace("execution: {package_install: allow}",
                         "execution: {package_install: allow, require_approval_for: [network_expansion]}")
    assert gated != BASE
    s = Session(gated)
    s.admit("s1")
    event = s.request("s1", "GET https://new.example.com/x")
    assert event.reason == "approval_required"
    result = learn(lines(s), Selector(sandbox="s1"), base_yaml=gated)
    assert [(r.host, r.paths) for r in result.rules] == [("new.example.com", ("/x",))]
    assert [(f.request_id, f.direction) for f in result.flips] == [(event.request_id, "deny->allow")]
