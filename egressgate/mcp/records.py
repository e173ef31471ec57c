"""The audit records of MCP mediation (docs/audit.md, "MCP"), built here once for both transports.

- `mcp_tool_call`: one per `tools/call` the gateway decided: what was proposed (server, tool, the
  sha256 of the canonical arguments — always —, the raw arguments only when the policy sets
  `mcp.record_arguments`, with secrets redacted), the decision, reason, rule and the facts it read
  (counts, pins, grants) so `audit replay` can decide it again.
- `outcome` (same request_id): what actually happened — result or JSON-RPC error, `isError`, result
  size, duration, or `no_response` when the session ended first.
- `mcp_tools_list`: a tools/list answer whose hashes differ from the pins (drift) or from the previous
  listing in the session; `mcp_message`: a message refused as malformed, a serverInfo that differs from
  its pin, an answer the gateway could not read.

Redaction of recorded arguments: the values of the route's credentials (broker/redact.py Scrubber,
every encoding it knows, any subset of characters escaped) and phantom tokens (broker/inject.py) are
replaced, raw or with any character escaped (broker/inject.py `redact_phantoms`, the escape-aware
matcher of broker/escapes.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from egressgate.audit.build import APPROVAL_ID, DETAIL, build
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.broker.inject import redact_phantoms
from egressgate.broker.redact import REPLACEMENT, SecretSpec, cached_scrubber
from egressgate.mcp.schema import arguments_hash, canonical

P = "egressgate.mcp."
SERVER, TOOL, TRANSPORT = P + "server", P + "tool", P + "transport"
ARGUMENTS_SHA256, ARGUMENTS = P + "arguments_sha256", P + "arguments"
JSONRPC_ID, FACTS, ARGUMENT = P + "jsonrpc_id", P + "facts", P + "argument"
OUTCOME, IS_ERROR, RESULT_BYTES, ERROR_CODE = P + "outcome", P + "is_error", P + "result_bytes", P + "error_code"
TOOLS, CHANGED, SERVER_INFO = P + "tools", P + "changed", P + "server_info"
_REDACTED = REPLACEMENT.decode()
MAX_NAME_CHARS = 256  # a tool name or id is the agent's text: bounded in records (the hash covers the rest)


def _bounded(text: str, extra: dict[str, Any], key: str) -> str:
    """`text` cut to MAX_NAME_CHARS; when cut, `<key>_sha256` names the whole (a record stays small and a
    collector's line limit is not the agent's to exceed)."""
    if len(text) <= MAX_NAME_CHARS:
        return text
    extra[key + "_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return text[:MAX_NAME_CHARS] + "..."


@dataclass(slots=True)
class Context:
    """Who and where: the fields every MCP record of one session shares."""

    sandbox_id: str
    labels: Mapping[str, str]
    policy_name: str
    policy_hash: str | None
    server: str
    transport: str  # "streamable_http" | "sse" | "stdio"
    scheme: str | None = None  # remote servers: the route
    host: str | None = None
    port: int | None = None
    path: str | None = None
    secrets: tuple[SecretSpec, ...] = field(default_factory=tuple)

    def base(self, kind: EventKind, extra: dict[str, Any], **fields: Any) -> AuditEvent:
        attributes = {SERVER: self.server, TRANSPORT: self.transport, **extra}
        target = dict(scheme=self.scheme, host=self.host, port=self.port, path=self.path,
                      method="POST" if self.host else None)
        target.update(fields)
        return build(kind, sandbox_id=self.sandbox_id, sandbox_labels=dict(self.labels),
                     policy_name=self.policy_name, policy_hash=self.policy_hash, extra=attributes, **target)


NETWORK_RULE, NETWORK_REASON = "egressgate.network.rule", "egressgate.network.reason"
NETWORK_DETAIL, NETWORK_APPROVAL_ID = "egressgate.network.detail", "egressgate.network.approval.id"


def fold_network(call: AuditEvent, network: AuditEvent) -> AuditEvent:
    """One record for a tools/call and the HTTP POST that carried it (docs/audit.md "MCP"): the POST's
    network decision record (gateway/pipeline/record.py, an allow: target, addresses, state, client, credential
    key) as an `mcp_tool_call` record under the POST's request id. Decision, reason, rule, message,
    detail and approval id are the call's; the network decision's own rule, reason, detail and approval
    id move to `egressgate.network.*`, so `audit replay` re-decides both (audit/replay_mcp.py)."""
    extra = dict(network.extra)
    moved = {NETWORK_RULE: network.rule_id, NETWORK_REASON: network.reason,
             NETWORK_DETAIL: extra.pop(DETAIL, None), NETWORK_APPROVAL_ID: extra.pop(APPROVAL_ID, None)}
    extra.update((k, v) for k, v in moved.items() if v is not None)
    extra.update(call.extra)
    return replace(network, kind=EventKind.MCP_TOOL_CALL, decision=call.decision, reason=call.reason,
                   rule_id=call.rule_id, message=call.message, extra=extra)


def fold_outcome(flow_outcome: AuditEvent, call_outcome: AuditEvent) -> AuditEvent:
    """One outcome record for a call and the POST that carried it, when the call's answer came after the
    POST ended (HTTP+SSE: the answer travels on the stream): the POST's outcome record (status, bytes,
    request hash, under the POST's request id, which is the call's) with the call's outcome attributes,
    stamped when the answer came and lasting until then."""
    durations = [d for d in (flow_outcome.duration_ms, call_outcome.duration_ms) if d is not None]
    return replace(flow_outcome, time_ns=max(flow_outcome.time_ns, call_outcome.time_ns),
                   duration_ms=max(durations) if durations else None,
                   extra={**flow_outcome.extra, **call_outcome.extra})


def redact_arguments(arguments: Any, secrets: Iterable[SecretSpec] = ()) -> str:
    """The canonical JSON text of `arguments` with every known secret and phantom replaced."""
    text = canonical(arguments).decode("utf-8")
    specs = tuple(secrets)
    if specs:
        text = cached_scrubber(*specs).scrub_text(text)  # compiled once per credential, not per record
    return redact_phantoms(text, _REDACTED)


def call_record(ctx: Context, *, request_id: str | None, jsonrpc_id: int | str | None, tool: str,
                arguments: Any, record_arguments: bool, decision: str, reason: str, rule_id: str | None,
                message: str, detail: str | None = None, failed_argument: str | None = None,
                approval_id: str | None = None, facts: dict[str, Any] | None = None) -> AuditEvent:
    extra: dict[str, Any] = {ARGUMENTS_SHA256: arguments_hash(arguments)}
    extra[TOOL] = _bounded(tool, extra, TOOL)
    extra[JSONRPC_ID] = _bounded(str(jsonrpc_id), extra, JSONRPC_ID)
    if record_arguments:
        extra[ARGUMENTS] = redact_arguments(arguments, ctx.secrets)
    if detail:
        extra[DETAIL] = detail
    if failed_argument:
        extra[ARGUMENT] = failed_argument
    if approval_id:
        extra[APPROVAL_ID] = approval_id
    if facts:
        extra[FACTS] = facts
    return ctx.base(EventKind.MCP_TOOL_CALL, extra, request_id=request_id, decision=decision, reason=reason,
                    rule_id=rule_id, message=message if decision == "deny" else None)


def outcome_record(ctx: Context, *, request_id: str, tool: str, jsonrpc_id: int | str | None,
                   duration_ms: float, response: Any = None, error: Any = None, no_response: bool = False,
                   response_bytes: int | None = None, detail: str | None = None) -> AuditEvent:
    """The effect of an allowed call: `result` (with `is_error` from the result's isError), `error` (a
    JSON-RPC error answer, with its code) or `no_response` (the session, or the POST that carried the
    call, ended before an answer; `detail` says why, e.g. `http_status=503`)."""
    extra: dict[str, Any] = {}
    extra[TOOL] = _bounded(tool, extra, TOOL)
    extra[JSONRPC_ID] = _bounded(str(jsonrpc_id), extra, JSONRPC_ID)
    if no_response:
        extra[OUTCOME] = "no_response"
        if detail is not None:
            extra[DETAIL] = detail
    elif error is not None:
        extra[OUTCOME] = "error"
        code = error.get("code") if isinstance(error, dict) else None
        if type(code) is int:
            extra[ERROR_CODE] = code
    else:
        extra[OUTCOME] = "result"
        extra[IS_ERROR] = isinstance(response, dict) and response.get("isError") is True
    if response_bytes is not None:
        extra[RESULT_BYTES] = response_bytes
    # no bytes_in: the HTTP outcome of the same POST already counts these bytes (metrics, replay history)
    return ctx.base(EventKind.OUTCOME, extra, request_id=request_id, duration_ms=round(duration_ms, 3))


def tools_list_record(ctx: Context, *, hashes: Mapping[str, str], changed: Iterable[str],
                      drifted: Iterable[str], visible: Iterable[str]) -> AuditEvent:
    """A tools/list answer that changed something: every tool's hash, which changed since the previous
    listing in this session, which differ from their pin (calls to them are denied mcp_schema_drift)."""
    drifted = sorted(drifted)
    extra: dict[str, Any] = {TOOLS: dict(sorted(hashes.items())), CHANGED: sorted(changed),
                             P + "drifted": drifted, P + "visible": sorted(visible)}
    return ctx.base(EventKind.MCP_TOOLS_LIST, extra, decision="deny" if drifted else "allow",
                    reason="mcp_schema_drift" if drifted else "rule_matched")


def message_record(ctx: Context, *, reason: str, detail: str, message: str, decision: str = "deny",
                   extra: dict[str, Any] | None = None) -> AuditEvent:
    attributes = dict(extra or {})
    attributes[DETAIL] = detail
    return ctx.base(EventKind.MCP_MESSAGE, attributes, decision=decision, reason=reason,
                    message=message if decision == "deny" else None)
