"""`egressgate policy check|explain|test` as an operator runs them (real subprocess, real exit codes)."""

from __future__ import annotations

import json

from egressgate.policy.enforcement import NAMED, REFUSED, set_keys
from egressgate.policy.loader import load_policy
from tests.support.cli import ROOT, cli

SEED = ROOT / "policies" / "seed-invoice-analysis.yaml"


def test_check_valid_and_invalid(tmp_path):
    ok = cli("policy", "check", str(ROOT / "policies" / "example-agent.yaml"))
    assert ok.returncode == 0, ok.stderr
    assert "example-agent" in ok.stdout and "sha256:" in ok.stdout
    # the article's policy: ok while everything it writes is enforced; each key nothing enforces yet
    # (policy/enforcement.py: package_install: deny and publish approval before the gateway classified them)
    # makes it exit 2 naming that key
    seed = cli("policy", "check", str(ROOT / "policies"))
    refused = [k for k in set_keys(load_policy(SEED).model) if NAMED[k].by == REFUSED]
    if refused:
        assert seed.returncode == 2 and seed.stdout == "", seed.stdout
        for key in refused:
            path, _, value = key.partition("=")
            assert f"{SEED}: {path}: {value!r} is accepted" in seed.stderr, seed.stderr
    else:
        assert seed.returncode == 0 and "invoice-analysis" in seed.stdout, seed.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("sandbox: {name: x}\nnetwork:\n  https:\n    allow:\n      - {host: a.example}\n"
                   "      - {host: b.example}\n      - {host: c.example, methods: [GET, 'B@D']}\n")
    out = cli("policy", "check", str(bad))
    assert out.returncode == 2
    assert f"{bad}: network.https.allow[2].methods[1]: bad method" in out.stderr


def test_explain_prints_decision_reason_rule():
    out = cli("policy", "explain", "--policy", str(SEED), "--sandbox", "invoice-analysis",
              "POST https://api.openai.com/v1/responses")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ALLOW  reason=rule_matched  rule=https.allow[0]")
    out = cli("policy", "explain", "--policy", str(SEED), "--json", "--resolved", "169.254.169.254",
              "GET https://files.pythonhosted.org/x")
    data = json.loads(out.stdout)
    assert (data["decision"], data["reason"]) == ("deny", "metadata_endpoint")
    out = cli("policy", "explain", "--policy", str(SEED), "GET https://user@api.openai.com/")
    assert out.returncode == 2
    assert "credentials in URLs (user@host) are refused" in out.stderr


def test_policy_test_passes_shipped_cases_and_diffs_failures(tmp_path):
    shipped = cli("policy", "test", str(ROOT / "policies" / "tests" / "seed-invoice-analysis.test.yaml"))
    assert shipped.returncode == 0, shipped.stdout
    assert "12 passed, 0 failed" in shipped.stdout
    cases = tmp_path / "cases.yaml"
    cases.write_text(f"""
policy: {SEED}
cases:
  - request: GET https://api.openai.com/v1/responses
    expect: allow
  - request: POST https://api.openai.com/v1/responses
    expect: allow
    rule: wrong-rule
  - request: POST https://api.openai.com/v1/responses
    expect: allow
""")
    out = cli("policy", "test", str(cases))
    assert out.returncode == 1
    assert "expected allow, got deny (approval_required)" in out.stdout
    assert "expected rule wrong-rule, got https.allow[0]" in out.stdout
    assert "1 passed, 2 failed" in out.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text("cases: [{request: GET https://x/, expect: maybe}]\n")
    assert cli("policy", "test", "--policy", str(SEED), str(broken)).returncode == 2
