"""A policy with an `mcp` section and helpers shared by the MCP engine tests."""

from __future__ import annotations

import json
import textwrap

from egressgate.policy.loader import parse_policy
from egressgate.policy.mcp_decide import McpFacts, ToolCall, decide_tool_call

POLICY = """
sandbox:
  name: mcp-t
network:
  allow_private: []
  https:
    allow:
      - host: tickets.mcp.test
        paths: ["/mcp", "/mcp/**"]
      - host: docs.allowed.test
        methods: [GET]
      - host: legacy.mcp.test
      - host: "*.wild.test"
        except_hosts: [evil.wild.test]
    deny:
      - host: docs.allowed.test
        paths: ["/private/**"]
mcp:
  servers:
    - name: tickets
      url: https://tickets.mcp.test/mcp
      budget: {calls: 5}
      tools:
        allow:
          - name: search_tickets
            id: tickets-search
            budget: {calls: 3}
            arguments:
              project: {equals_label: tenant, required: true}
              limit: {type: integer, min: 1, max: 50}
              status: {enum: [open, closed]}
              query: {type: string, pattern: "^[a-z ]{1,40}$", max_length: 40}
              path: {path_prefix: /workspace/}
              url: {allowed_by_network: true}
              ratio: {type: number, min: 0, max: 1}
              flag: {type: boolean}
          - name: delete_ticket
          - name: wide_open
            unlisted_arguments: allow
          - name: escalate
            approval: required
        deny: [delete_ticket, purge]
    - name: legacy
      url: https://legacy.mcp.test/sse
      transport: sse
      server_info: {name: legacy-server, version: "1.4.2"}
      trust_on_first_use: false
      tool_schemas: {lookup: "%s"}
      tools:
        allow:
          - name: lookup
          - name: unpinned
    - name: localfs
      local: true
      tools:
        allow:
          - name: read_file
            arguments:
              path: {path_prefix: /workspace, required: true}
""" % ("a" * 64)

PIN = "a" * 64


def policy(text: str = POLICY):
    return parse_policy(textwrap.dedent(text), "mcp.yaml")


def facts(**kw) -> McpFacts:
    base = dict(sandbox_id="sb-1", labels={"tenant": "acme"}, server_calls=0, tool_calls=0,
                server_info_seen=None, tool_schema_seen=None, tool_schema_now=None, server_info_now=None)
    base.update(kw)
    return McpFacts(**base)


def call(compiled, tool: str, arguments: dict | str | None = None, server: str = "tickets", now: float = 1000.0,
         **fact_kw):
    """`arguments` may be raw JSON text: it is decoded the way the JSON-RPC parser decodes (escapes included)."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    args = {"project": "acme"} if arguments is None else arguments
    return decide_tool_call(compiled, ToolCall(server, tool, args), facts(**fact_kw), now)
