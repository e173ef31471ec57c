"""`policy explain --fail`: exit 1 on a DENY, so a script or CI job can ask "would this be allowed?" by exit
code. Without the flag explain exits 0 whatever the decision (it answered the question); 2 stays "the
policy is invalid" either way. Runs the real CLI on the repository's policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import POLICIES, cli

SEED = ("--policy", str(POLICIES), "--sandbox", "invoice-analysis")
ALLOWED = "POST https://api.openai.com/v1/responses"
DENIED = "GET https://evil.example/"
MCP = (str(POLICIES / "tickets.yaml"), "--mcp-server", "tickets", "--tool", "search_tickets", "--label", "tenant=acme")


@pytest.mark.parametrize(("args", "code", "first"), [
    ((*SEED, "--fail", ALLOWED), 0, "ALLOW"),
    ((*SEED, "--fail", DENIED), 1, "DENY"),
    ((*SEED, DENIED), 0, "DENY"),  # without --fail: unchanged, exit 0
    ((*MCP, "--fail", "--arguments", '{"project": "acme"}'), 0, "ALLOW"),
    ((*MCP, "--fail", "--arguments", '{"project": "globex"}'), 1, "DENY"),
])
def test_fail_exits_1_on_deny_only(args: tuple[str, ...], code: int, first: str) -> None:
    res = cli("policy", "explain", *args)
    assert res.returncode == code, res.stdout + res.stderr
    assert res.stdout.startswith(first + "  reason="), res.stdout  # the decision is printed either way


def test_fail_with_json(tmp_path: Path) -> None:
    res = cli("policy", "explain", *SEED, "--json", "--fail", DENIED)
    assert res.returncode == 1 and json.loads(res.stdout)["decision"] == "deny", res.stdout + res.stderr


def test_an_invalid_policy_is_still_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("sandbox: {name: x}\nnetwork: {nope: 1}\n")
    res = cli("policy", "explain", "--policy", str(bad), "--fail", DENIED)
    assert res.returncode == 2, res.stdout + res.stderr
