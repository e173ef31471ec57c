"""`audit replay` of MCP tool calls: re-decide `mcp_tool_call` records under another policy.

The decision is the same pure `policy.mcp_decide.decide_tool_call` the gateway ran, on what the record
carries (egressgate/mcp/records.py, docs/audit.md "MCP"): server, tool, the sandbox labels, and in
`egressgate.mcp.facts` the counts, pins (seen / now) and grants it read.

- Arguments recorded (`mcp.record_arguments: true`): the call is re-decided fully. A recorded value with a
  redacted secret (`[REDACTED]`) is not the value the tool received, so such a record is treated as
  having no arguments.
- Arguments not recorded (the default: only their sha256 is): server, tool, pins, budgets and approval
  are re-decided and argument constraints are NOT checked; the summary counts the calls this allows
  (a deny holds whatever the arguments are). A record the recording policy refused for an argument is then skipped: a
  replay cannot know whether the new constraints would hold.
- A record without `egressgate.mcp.facts`: counts come from the log (allowed calls before it), pins are
  taken to hold; it counts as reconstructed state, like network records without recorded state.
- A record that also states the network decision of the HTTP POST that carried the call (one record per
  call: `egressgate.network.rule` / `.reason`, mcp/records.fold_network) is two decisions: `network_view`
  gives the POST's `http_request` record back (an allow, with its facts and state), re-decided and
  counted in the sandbox's history like any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from egressgate.audit.record import K_LABELS
from egressgate.audit.replay_state import grants_from
from egressgate.policy.mcp_decide import McpFacts, ToolCall, decide_tool_call

OPERATION = "mcp_tool_call"
P = "egressgate.mcp."
REDACTED = "[REDACTED]"
# Refusals made before or outside the policy (the mediator, the parser, dependencies): not re-decided.
NOT_POLICY = frozenset({"mcp_malformed", "state_unavailable", "audit_unavailable", "sandbox_revoked",
                        "policy_unavailable", "identity_unknown", "identity_address_mismatch",
                        "internal_error"})


@dataclass(slots=True)
class McpHistory:
    """Allowed calls seen so far in the log, per sandbox: `mcp:<server>` and `mcp:<server>/<tool>` keys."""

    calls: dict[tuple[str, str], int] = field(default_factory=dict)

    def update(self, sandbox_id: str, attrs: dict[str, Any]) -> None:
        if attrs.get("egressgate.operation") != OPERATION or attrs.get("egressgate.decision") != "allow":
            return
        server, tool = attrs.get(P + "server"), attrs.get(P + "tool")
        if isinstance(server, str) and isinstance(tool, str):
            for key in (f"mcp:{server}", f"mcp:{server}/{tool}"):
                self.calls[(sandbox_id, key)] = self.calls.get((sandbox_id, key), 0) + 1


@dataclass(frozen=True, slots=True)
class Replayed:
    decision: Any  # ToolDecision
    exact_state: bool
    arguments_checked: bool
    target: str


_NETWORK = {"egressgate.network.rule": "egressgate.rule", "egressgate.network.reason": "egressgate.reason",
            "egressgate.network.detail": "egressgate.detail",
            "egressgate.network.approval.id": "egressgate.approval.id"}


def network_view(attrs: dict[str, Any]) -> dict[str, Any] | None:
    """The folded POST's own `http_request` decision (an allow) from an `mcp_tool_call` record, or None
    when the record states the call alone (stdio, a batch's other calls, records before the fold)."""
    if attrs.get("egressgate.network.reason") is None:
        return None
    view = {k: v for k, v in attrs.items() if not k.startswith(P) and k not in (
        "egressgate.rule", "egressgate.reason", "egressgate.detail", "egressgate.approval.id", "egressgate.message")}
    for key, to in _NETWORK.items():
        view.pop(key, None)
        if attrs.get(key) is not None:
            view[to] = attrs[key]
    view["egressgate.operation"] = "http_request"
    view["egressgate.decision"] = "allow"
    return view


class NotReplayable(Exception):
    """`str(exc)` is the reason the record is skipped (the summary's `skipped N: ...` line)."""


def _int(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


def _pair(value: Any) -> tuple[str, str] | None:
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return value[0], value[1]
    return None


def _arguments(attrs: dict[str, Any]) -> dict[str, Any] | None:
    raw = attrs.get(P + "arguments")
    if not isinstance(raw, str) or REDACTED in raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def replay_tool_call(policy: Any, attrs: dict[str, Any], sandbox_id: str, hist: McpHistory, time_s: float) -> Replayed:
    old, reason = attrs.get("egressgate.decision"), attrs.get("egressgate.reason")
    if old not in ("allow", "deny"):
        raise NotReplayable("no recorded decision")
    if old == "deny" and reason in NOT_POLICY:
        raise NotReplayable(f"decided outside the policy ({reason})")
    server, tool = attrs.get(P + "server"), attrs.get(P + "tool")
    if not isinstance(server, str) or not isinstance(tool, str):
        raise NotReplayable("record lacks the facts to re-decide")
    labels_raw = attrs.get(K_LABELS)
    labels = {str(k): str(v) for k, v in labels_raw.items()} if isinstance(labels_raw, dict) else {}
    recorded = attrs.get(P + "facts")
    if isinstance(recorded, dict):
        facts = McpFacts(
            sandbox_id=sandbox_id, labels=labels,
            server_calls=_int(recorded.get("server_calls")), tool_calls=_int(recorded.get("tool_calls")),
            server_info_seen=_pair(recorded.get("server_info_seen")),
            tool_schema_seen=recorded.get("tool_schema_seen") if isinstance(recorded.get("tool_schema_seen"),
                                                                            str) else None,
            tool_schema_now=recorded.get("tool_schema_now") if isinstance(recorded.get("tool_schema_now"),
                                                                          str) else None,
            server_info_now=_pair(recorded.get("server_info_now")),
            grants=grants_from(recorded.get("grants")),
        )
    else:
        compiled = policy.mcp.servers.get(server)
        facts = McpFacts(
            sandbox_id=sandbox_id, labels=labels,
            server_calls=hist.calls.get((sandbox_id, f"mcp:{server}"), 0),
            tool_calls=hist.calls.get((sandbox_id, f"mcp:{server}/{tool}"), 0),
            server_info_seen=None, tool_schema_seen=None,
            server_info_now=compiled.server_info if compiled else None,
            tool_schema_now=compiled.tool_schemas.get(tool) if compiled else None,
        )
    arguments = _arguments(attrs)
    known = arguments is not None
    decision = decide_tool_call(policy, ToolCall(server, tool, arguments or {}), facts, time_s,
                                check_arguments=known)
    if not known and decision.allowed and reason == "mcp_argument_denied":
        raise NotReplayable("argument checks not replayable (arguments not recorded; set mcp.record_arguments)")
    # A deny holds whatever the arguments are (they could only turn an allow into a deny): only an allow
    # re-decided without them is uncertain.
    return Replayed(decision, isinstance(recorded, dict), known or not decision.allowed, f"mcp {server}/{tool}")
