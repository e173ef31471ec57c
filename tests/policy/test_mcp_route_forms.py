"""Adversarial review (h-review): paths a lenient MCP server routes to its endpoint are MCP routes.

With an allow rule for the whole host (a common policy: `- host: tickets.mcp.test`), a POST whose path the
gateway did not see as the MCP endpoint was forwarded raw, tool calls and all, unmediated. Express and
ASP.NET (the TypeScript and C# MCP SDKs' usual hosts) route `/MCP` and `/mcp/` to `/mcp`; Tomcat (Java SDK)
drops `;jsessionid=x`; nginx merges `//`; some servers decode `%2F`/`%5C` before routing (`/mcp%2F` is
`/mcp/`). Each must be an MCP route (decided per tool call), and each is one the network rule allows.
(Encoded dot segments, `/x%2F..%2Fmcp`, are already refused by canon_path.)"""

from __future__ import annotations

import textwrap
import time
from types import MappingProxyType

import pytest

from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.mcp_decide import mcp_server_for
from egressgate.policy.target import parse_target

POLICY = parse_policy(textwrap.dedent("""
    sandbox: {name: erv-route}
    network:
      https:
        allow:
          - host: tickets.mcp.test
    mcp:
      servers:
        - name: tickets
          url: https://tickets.mcp.test/mcp
          tools:
            allow: [{name: search_tickets}]
"""), "erv-route.yaml")

LENIENT = ["/MCP", "/Mcp/", "/mcp;jsessionid=1", "/mcp%2F", "/mcp%2fx", "//mcp", "/mcp%5Cx", "//MCP;a=b//",
           "/MCP/sub", "/%4dCP"]


def _network_allows(path: str) -> bool:
    facts = parse_target(f"POST https://tickets.mcp.test{path}")
    now = time.time()
    state = SandboxState(sandbox_id="erv", admitted_at=now, labels=MappingProxyType({}))
    return decide(POLICY, facts, state, now).allowed


@pytest.mark.parametrize("raw", LENIENT)
def test_a_path_a_lenient_server_routes_to_the_endpoint_is_an_mcp_route(raw: str):
    facts = parse_target(f"POST https://tickets.mcp.test{raw}")
    assert _network_allows(raw)  # the network rule lets it through: only the MCP route can mediate it
    server = mcp_server_for(POLICY, facts.scheme, facts.host, facts.port, facts.path)
    assert server is not None and server.name == "tickets"


@pytest.mark.parametrize("raw", ["/mcp", "/mcp/", "/mcp/x"])
def test_positive_control_the_endpoint_itself(raw: str):
    facts = parse_target(f"POST https://tickets.mcp.test{raw}")
    assert mcp_server_for(POLICY, facts.scheme, facts.host, facts.port, facts.path).name == "tickets"


@pytest.mark.parametrize("raw", ["/mcpx", "/other", "/", "/x/mcp"])
def test_other_paths_of_the_origin_stay_plain_requests(raw: str):
    facts = parse_target(f"POST https://tickets.mcp.test{raw}")
    assert _network_allows(raw)
    assert mcp_server_for(POLICY, facts.scheme, facts.host, facts.port, facts.path) is None
