"""`egressgate policy explain --mcp-server S --tool T --arguments JSON`: what the policy says about one call.

The same pure decide_tool_call the gateway runs. What the CLI cannot know about a live session is given as
options, and by default the pins hold: the session is taken to have seen the pinned serverInfo and tool
schema (so the answer is about tools, arguments, budgets and approval), unless --server-info or
--tool-schema name what the server reported. The arguments are parsed as strictly as the gateway parses
JSON-RPC (no duplicate keys, no NaN/Infinity, an object), so a call that explains as allowed is one the
gateway would read the same way.
"""

from __future__ import annotations

import json
from typing import Any

from egressgate.policy.compile import CompiledPolicy
from egressgate.policy.mcp_decide import McpFacts, ToolCall, ToolDecision, decide_tool_call


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in --arguments")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (in --arguments)")


def parse_arguments(text: str) -> dict[str, Any]:
    """A strict JSON object (ValueError otherwise)."""
    value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    if not isinstance(value, dict):
        raise ValueError("--arguments must be a JSON object")
    return value


def explain_tool_call(
    policy: CompiledPolicy,
    server: str,
    tool: str,
    arguments: dict[str, Any],
    labels: dict[str, str],
    *,
    server_calls: int = 0,
    tool_calls: int = 0,
    server_info: tuple[str, str] | None = None,
    tool_schema: str | None = None,
    now: float,
) -> tuple[ToolDecision, dict[str, Any]]:
    compiled = policy.mcp.servers.get(server)
    pinned_info = compiled.server_info if compiled else None
    pinned_schema = compiled.tool_schemas.get(tool) if compiled else None
    facts = McpFacts(
        sandbox_id="explain", labels=labels, server_calls=server_calls, tool_calls=tool_calls,
        server_info_seen=None, tool_schema_seen=None,
        tool_schema_now=tool_schema if tool_schema is not None else pinned_schema,
        server_info_now=server_info if server_info is not None else pinned_info,
    )
    decision = decide_tool_call(policy, ToolCall(server, tool, arguments), facts, now)
    out = {
        "decision": decision.decision,
        "reason": decision.reason.value,
        "rule": decision.rule_id,
        "detail": decision.detail,
        "failed_argument": decision.failed_argument,
        "approval_kind": decision.approval_kind,
        "budget_keys": [list(k) for k in decision.budget_keys],
        "message": decision.message or None,
        "policy": policy.name,
        "policy_hash": policy.hash,
        "server": server,
        "tool": tool,
        "server_url": compiled.url if compiled else None,
    }
    return decision, out
