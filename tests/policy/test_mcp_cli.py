"""`egressgate policy check|explain` with an `mcp` section, as an operator runs them (real subprocess)."""

from __future__ import annotations

import json

from tests.policy.mcp_support import POLICY
from tests.support.cli import cli


def test_check_and_explain_tool_calls(tmp_path):
    path = tmp_path / "mcp.yaml"
    path.write_text(POLICY)
    out = cli("policy", "check", str(path))
    assert out.returncode == 0, out.stderr
    assert "3 mcp servers" in out.stdout

    # positional POLICY form (PLAN-13), allowed call, then the same call for another tenant
    out = cli("policy", "explain", str(path), "--mcp-server", "tickets", "--tool", "search_tickets",
              "--arguments", '{"project": "acme", "limit": 5}', "--label", "tenant=acme")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ALLOW  reason=rule_matched  rule=tickets-search")
    assert "mcp:tickets/search_tickets (max 3)" in out.stdout
    out = cli("policy", "explain", "--policy", str(path), "--json", "--mcp-server", "tickets", "--tool",
              "search_tickets", "--arguments", '{"project": "globex"}', "--label", "tenant=acme")
    data = json.loads(out.stdout)
    assert (data["decision"], data["reason"], data["failed_argument"], data["detail"]) == \
        ("deny", "mcp_argument_denied", "project", "label_mismatch")
    assert "globex" not in data["message"]

    # smuggling in the CLI's own input is refused, not guessed: duplicate keys
    out = cli("policy", "explain", str(path), "--mcp-server", "tickets", "--tool", "search_tickets",
              "--arguments", '{"project": "acme", "project": "globex"}')
    assert out.returncode == 2 and "duplicate key 'project'" in out.stderr


def test_check_reports_mcp_errors_with_key_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(POLICY.replace("  - name: legacy\n", "  - name: tickets\n"))
    out = cli("policy", "check", str(path))
    assert out.returncode == 2
    assert f"{path}: mcp.servers[1].name: duplicate server name 'tickets' (also mcp.servers[0])" in out.stderr
