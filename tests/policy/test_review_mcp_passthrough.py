"""Adversarial review (h-review): an MCP server behind a `tls: passthrough` rule is refused at load.

A passthrough tunnel is spliced unread (policy/passthrough.py), so no tools/call inside it can be parsed,
decided or recorded; the policy loaded fine and its `mcp` section only looked enforced. The CONNECT
decision below is the evidence: with the passthrough rule the tunnel is spliced (not intercepted), so the
gateway's MCP route never sees a request. Positive control: the same policy without it loads and
intercepts."""

from __future__ import annotations

import textwrap
import time
from types import MappingProxyType

import pytest

from egressgate.policy.decide import decide
from egressgate.policy.errors import PolicyError
from egressgate.policy.facts import Facts, Operation, SandboxState
from egressgate.policy.loader import parse_policy

BASE = """
sandbox: {name: erv-passthrough}
network:
  https:
    allow:
%s      - {host: tickets.mcp.test, paths: ["/mcp"]}
mcp:
  servers:
    - name: tickets
      url: https://tickets.mcp.test/mcp
      tools: {allow: [{name: search_tickets}]}
"""
SPLICING = [
    "      - {id: spliced, host: tickets.mcp.test, tls: passthrough}\n",
    "      - {id: spliced, host: '*.mcp.test', ports: [443], tls: passthrough}\n",
]


def _connect(policy):
    now = time.time()
    state = SandboxState(sandbox_id="erv", admitted_at=now, labels=MappingProxyType({}))
    return decide(policy, Facts(Operation.CONNECT, "tickets.mcp.test", 443), state, now)


@pytest.mark.parametrize("rule", SPLICING)
def test_an_mcp_server_behind_a_passthrough_rule_is_refused(rule: str):
    text = textwrap.dedent(BASE % rule)
    without_mcp = parse_policy(text.split("mcp:\n")[0], "erv-passthrough.yaml")
    assert _connect(without_mcp).passthrough  # the evidence: such a tunnel is spliced unread
    with pytest.raises(PolicyError) as refused:
        parse_policy(text, "erv-passthrough.yaml")
    assert "mcp.servers[0].url" in str(refused.value) and "spliced" in str(refused.value)


@pytest.mark.parametrize("rule", ["", "      - {id: other, host: other.mcp.test, tls: passthrough}\n",
                                  "      - {id: port, host: tickets.mcp.test, ports: [8443], tls: passthrough}\n"])
def test_positive_control_an_intercepted_mcp_server_loads(rule: str):
    policy = parse_policy(textwrap.dedent(BASE % rule), "erv-passthrough.yaml")
    assert policy.mcp.servers["tickets"].host == "tickets.mcp.test"
    assert _connect(policy).intercept
