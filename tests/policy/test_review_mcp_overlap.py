"""Adversarial review (h-review): two MCP servers of one origin with overlapping routes are refused at load.

mcp_server_for hands a request to the first listed server whose route covers its path, so a call to a
stricter server nested under another's path (`/mcp/admin` under `/mcp`) was decided by the OTHER server's
tool rules: a tool name both offer (`search`) passed the lenient list and ran on the strict server. The
evidence is below (the nested route resolves to the wrong server); positive control: disjoint paths on
one origin load, and each path resolves to its own server."""

from __future__ import annotations

import textwrap

import pytest

from egressgate.policy.errors import PolicyError
from egressgate.policy.loader import parse_policy
from egressgate.policy.mcp_decide import mcp_server_for

POLICY = """
sandbox: {name: erv-overlap}
network:
  https:
    allow:
      - {host: api.mcp.test}
mcp:
  servers:
    - name: docs
      url: https://api.mcp.test%s
      %s
      tools: {allow: [{name: search}]}
    - name: admin
      url: https://api.mcp.test%s
      tools:
        allow: [{name: search, arguments: {project: {equals_label: tenant, required: true}}}]
"""


def _policy(first: str, second: str, transport: str = ""):
    return parse_policy(textwrap.dedent(POLICY % (first, transport, second)), "erv-overlap.yaml")


@pytest.mark.parametrize(("first", "second", "transport"), [
    ("/mcp", "/mcp/admin", ""),
    ("/mcp/", "/MCP/admin", ""),
    ("/mcp/admin", "/mcp", ""),
])
def test_overlapping_mcp_routes_on_one_origin_are_refused(first: str, second: str, transport: str):
    with pytest.raises(PolicyError) as refused:
        _policy(first, second, transport)
    assert "mcp.servers[1].url" in str(refused.value) and "overlaps" in str(refused.value)


def test_the_evidence_a_nested_route_resolves_to_the_server_listed_first():
    alone = _policy("/mcp", "/elsewhere/mcp")  # the admin server moved away: this loads
    assert mcp_server_for(alone, "https", "api.mcp.test", 443, "/mcp/admin").name == "docs"


def test_two_sse_servers_on_one_origin_are_refused():
    text = textwrap.dedent(POLICY % ("/old/sse", "transport: sse", "/admin/sse")).replace(
        "      tools:\n        allow: [{name: search, arguments",
        "      transport: sse\n      tools:\n        allow: [{name: search, arguments")
    with pytest.raises(PolicyError) as refused:
        parse_policy(text, "erv-overlap.yaml")
    assert "mcp.servers[1].url" in str(refused.value) and "overlaps" in str(refused.value)


def test_an_sse_server_listed_first_no_longer_swallows_a_streamable_route():
    policy = _policy("/old/sse", "/admin/mcp", "transport: sse")  # one sse + one streamable: allowed
    assert mcp_server_for(policy, "https", "api.mcp.test", 443, "/admin/mcp").name == "admin"  # was "docs"
    assert mcp_server_for(policy, "https", "api.mcp.test", 443, "/messages/").name == "docs"  # the sse one


def test_positive_control_disjoint_routes_on_one_origin():
    policy = _policy("/docs/mcp", "/admin/mcp")
    assert mcp_server_for(policy, "https", "api.mcp.test", 443, "/docs/mcp").name == "docs"
    assert mcp_server_for(policy, "https", "api.mcp.test", 443, "/admin/mcp").name == "admin"
