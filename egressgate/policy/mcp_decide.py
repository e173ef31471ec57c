"""PURE decisions for MCP: which route is an MCP server, and what one `tools/call` may do.

The mediator (egressgate/mcp/mediator.py) gathers the facts (counts, pins seen, grants) and commits the
result (counts budgets atomically, records pins and audit); `audit replay` calls the same function with the
facts a record carries. Nothing here reads a clock, a store or the network: `now` is passed in.

Order of the checks for `decide_tool_call`, first failure wins (deny always wins over allow):
1. the server is in the policy (`mcp_tool_denied`), 2. the tool is not in `tools.deny` (`mcp_tool_denied`,
its deny entry as rule), 3. the tool is in `tools.allow` (`mcp_tool_denied`: default deny), 4. the server's
`serverInfo` is the pinned one, or (trust on first use) the one first recorded for this sandbox
(`mcp_server_changed`), 5. the tool's schema hash is the pinned one (a pinned tool must have been listed
this session) or the one first recorded (`mcp_schema_drift`), 6. every argument constraint holds
(`mcp_argument_denied`, naming the argument, never its value), 7. server and tool budgets
(`budget_exceeded`), 8. `approval: required` needs a live grant for this sandbox, server and tool
(`approval_required`, approval kind `mcp_tool`; `approval_granted` when covered).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from egressgate.approvals.grant import Grant
from egressgate.policy.canon import CanonError, canon_host, parse_ip_literal
from egressgate.policy.compile import CompiledPolicy
from egressgate.policy.decide import decide
from egressgate.policy.facts import Facts, Operation, SandboxState
from egressgate.policy.mcp_args import check_arguments as check_tool_arguments
from egressgate.policy.mcp_compile import McpServer, McpTool
from egressgate.policy.messages import mcp_message
from egressgate.policy.reasons import Reason
from egressgate.policy.target import parse_url

APPROVAL_KIND_MCP_TOOL = "mcp_tool"
# An approval of one tool is stored as a Grant (egressgate/approvals) with these fields: scheme "mcp",
# host = server name, port 0, method "tools/call", path = tool name. Port 0 and the scheme keep such a
# grant from ever covering a network request (approvals/overlay.covers compares host AND port).
MCP_GRANT_SCHEME = "mcp"
MCP_GRANT_PORT = 0
MCP_GRANT_METHOD = "tools/call"
_MAX_URL = 8192  # longer URL arguments are refused (bad_url:too_long) before canonicalization or caching


@dataclass(frozen=True, slots=True)
class ToolCall:
    server: str
    tool: str
    arguments: Mapping[str, Any]  # strictly parsed JSON object (mcp/jsonrpc.py), escapes decoded


@dataclass(frozen=True, slots=True)
class McpFacts:
    sandbox_id: str
    labels: Mapping[str, str]
    server_calls: int  # calls already counted for this server (this sandbox)
    tool_calls: int  # calls already counted for this tool
    server_info_seen: tuple[str, str] | None  # (name, version) first recorded for this sandbox (TOFU)
    tool_schema_seen: str | None  # sha256 first recorded for this tool (TOFU)
    tool_schema_now: str | None  # sha256 in the latest tools/list this session saw
    server_info_now: tuple[str, str] | None  # this session's initialize result
    grants: tuple[Grant, ...] = ()  # live approvals of this sandbox
    # The sandbox's network state for `allowed_by_network` (conditions, approvals); None: labels only,
    # admitted now, no history (a `when` that needs more then refuses, as it would for a new sandbox).
    network_state: SandboxState | None = None


@dataclass(frozen=True, slots=True)
class ToolDecision:
    decision: str  # "allow" | "deny"
    reason: Reason
    rule_id: str | None
    message: str  # one actionable sentence (empty on allow)
    budget_keys: tuple[tuple[str, int], ...] = ()  # (counter key, max) to count at commit (allow only)
    approval_kind: str | None = None  # "mcp_tool" when approval is required and not granted
    failed_argument: str | None = None  # the argument that failed (never its value)
    detail: str | None = None  # machine detail (argument check, budget key, pin kind)
    approval_id: str | None = None  # approval_granted: the grant that allowed the call

    @property
    def allowed(self) -> bool:
        return self.decision == "allow"


def mcp_server_for(policy: CompiledPolicy, scheme: str, host: str, port: int, path: str) -> McpServer | None:
    """The remote MCP server a request (canonical scheme/host/port/path) is a route to, or None."""
    for server in policy.mcp.by_origin.get((scheme, host, port), ()):
        if server.serves_path(path):
            return server
    return None


def mcp_post_server(policy: CompiledPolicy, scheme: str, host: str, port: int, method: str,
                    path: str) -> McpServer | None:
    """The remote MCP server a request POSTs JSON-RPC messages to (gateway/mcp/route.py's role `post`):
    a POST on the route that is not the HTTP+SSE transport's stream URL. None: not such a POST."""
    if method != "POST":
        return None
    server = mcp_server_for(policy, scheme, host, port, path)
    if server is None or (server.transport == "sse" and path == server.path):
        return None
    return server


def local_server(policy: CompiledPolicy, name: str) -> McpServer | None:
    server = policy.mcp.servers.get(name)
    return server if server is not None and server.local else None


def decide_local_start(policy: CompiledPolicy, name: str) -> ToolDecision:
    """May `egressgate mcp run --server NAME` start this local server? Both `execution.local_mcp_servers:
    allow` and a `local: true` entry named NAME are needed; otherwise `mcp_local_denied`."""
    server = local_server(policy, name)
    detail = ("execution_denied" if policy.model.execution.local_mcp_servers != "allow"
              else "not_local" if server is None else None)
    if detail is not None:
        message = mcp_message(policy, Reason.MCP_LOCAL_DENIED, name, None, detail=detail)
        return ToolDecision("deny", Reason.MCP_LOCAL_DENIED, None, message, detail=detail)
    return ToolDecision("allow", Reason.RULE_MATCHED, f"mcp:{name}", "")


def mcp_grant_covers(grant: Grant, sandbox_id: str, server: str, tool: str, now: float) -> bool:
    return (grant.scheme == MCP_GRANT_SCHEME and grant.port == MCP_GRANT_PORT and grant.host == server
            and grant.path == tool and grant.sandbox_id == sandbox_id and now < grant.expires_at)


def decide_tool_call(
    policy: CompiledPolicy, call: ToolCall, facts: McpFacts, now: float, *, check_arguments: bool = True
) -> ToolDecision:
    """`check_arguments=False` is for `audit replay` of a record without its arguments only: step 6 is
    skipped, every other step is decided as usual (the gateway never passes it)."""
    server = policy.mcp.servers.get(call.server)
    if server is None:
        return _deny(policy, call, Reason.MCP_TOOL_DENIED, None, detail="unknown_server")
    if type(call.tool) is not str:  # a name that is not a JSON string is never a listed tool
        return _deny(policy, call, Reason.MCP_TOOL_DENIED, None, detail="not_allowed")
    deny_rule = server.denied.get(call.tool)
    if deny_rule is not None:
        return _deny(policy, call, Reason.MCP_TOOL_DENIED, deny_rule, detail="denied_by_rule")
    tool = server.allowed.get(call.tool)
    if tool is None:
        return _deny(policy, call, Reason.MCP_TOOL_DENIED, None, detail="not_allowed")
    pin_failure = _pin_failure(server, tool.name, facts)
    if pin_failure is not None:
        return _deny(policy, call, pin_failure[0], tool.rule_id, detail=pin_failure[1])
    failure = (check_tool_arguments(tool, call.arguments, facts.labels,
                                    lambda v: _network_refusal(policy, facts, v, now)) if check_arguments else None)
    if failure is not None:
        return _deny(policy, call, Reason.MCP_ARGUMENT_DENIED, tool.rule_id, detail=failure.detail,
                     argument=failure.argument)
    keys = _budget_keys(server, tool)
    if server.budget_calls is not None and facts.server_calls >= server.budget_calls:
        return _deny(policy, call, Reason.BUDGET_EXCEEDED, tool.rule_id, detail=f"mcp:{server.name}")
    if tool.budget_calls is not None and facts.tool_calls >= tool.budget_calls:
        return _deny(policy, call, Reason.BUDGET_EXCEEDED, tool.rule_id, detail=f"mcp:{server.name}/{tool.name}")
    if tool.approval_required:
        grant = next((g for g in facts.grants if mcp_grant_covers(g, facts.sandbox_id, server.name, tool.name,
                                                                   now)), None)
        if grant is None:
            return _deny(policy, call, Reason.APPROVAL_REQUIRED, tool.rule_id, detail=APPROVAL_KIND_MCP_TOOL,
                         approval_kind=APPROVAL_KIND_MCP_TOOL)
        return ToolDecision("allow", Reason.APPROVAL_GRANTED, tool.rule_id, "", keys, approval_id=grant.id)
    return ToolDecision("allow", Reason.RULE_MATCHED, tool.rule_id, "", keys)


def visible_tools(
    policy: CompiledPolicy, server: str, tools: list[dict], drifted: frozenset[str] = frozenset()
) -> list[dict]:
    """A `tools/list` result reduced to the tools a call could be allowed for: listed in `tools.allow`, not
    in `tools.deny`, not in `drifted` (tools whose schema changed, from the mediator). A name listed twice
    is dropped entirely (which entry would the client keep?), as is anything that is not a named tool."""
    compiled = policy.mcp.servers.get(server)
    if compiled is None:
        return []
    names = [t.get("name") if isinstance(t, dict) else None for t in tools]
    counts: dict[Any, int] = {}
    for name in names:
        if isinstance(name, str):
            counts[name] = counts.get(name, 0) + 1
    return [
        tool for tool, name in zip(tools, names, strict=True)
        if isinstance(name, str) and counts[name] == 1 and name in compiled.allowed
        and name not in compiled.denied and name not in drifted
    ]


def _pin_failure(server: McpServer, tool: str, facts: McpFacts) -> tuple[Reason, str] | None:
    info = facts.server_info_now
    if server.server_info is not None:
        if info != server.server_info:  # not seen this session is no better than a different one
            return Reason.MCP_SERVER_CHANGED, "server_info_pin" if info is not None else "server_info_unseen"
    elif server.trust_on_first_use and info is not None and facts.server_info_seen not in (None, info):
        return Reason.MCP_SERVER_CHANGED, "server_info_tofu"
    pin = server.tool_schemas.get(tool)
    schema = facts.tool_schema_now
    if pin is not None:
        if schema != pin:
            return Reason.MCP_SCHEMA_DRIFT, "tool_schema_pin" if schema is not None else "tool_schema_unseen"
    elif server.trust_on_first_use and schema is not None and facts.tool_schema_seen not in (None, schema):
        return Reason.MCP_SCHEMA_DRIFT, "tool_schema_tofu"
    return None


def _budget_keys(server: McpServer, tool: McpTool) -> tuple[tuple[str, int], ...]:
    keys = []
    if server.budget_calls is not None:
        keys.append((f"mcp:{server.name}", server.budget_calls))
    if tool.budget_calls is not None:
        keys.append((f"mcp:{server.name}/{tool.name}", tool.budget_calls))
    return tuple(keys)


@functools.lru_cache(maxsize=4096)
def _url_request(value: str) -> Facts | str:
    """The request a URL/host argument names (canonical, no DNS), or `bad_url:<code>`. Pure, so cached:
    canonicalization is most of the cost of an `allowed_by_network` check (bounded: values are the
    sandbox's)."""
    try:
        if "://" in value:
            url = parse_url(value)
            scheme, host, port, path = url.scheme, url.host, url.port, url.path
        else:
            scheme, host, port, path = "https", canon_host(value), 443, "/"
    except CanonError as exc:
        return f"bad_url:{exc.code}"
    literal = parse_ip_literal(host)
    return Facts(Operation.HTTP_REQUEST, host, port, scheme=scheme, method="GET", path=path,
                 addresses=(literal,) if literal is not None else ())


def _network_refusal(policy: CompiledPolicy, facts: McpFacts, value: str, now: float) -> str | None:
    """None when the sandbox could fetch `value` (an http(s) URL, or a bare host as https://host/) under
    its own network policy: the same decide() as its requests, no DNS resolution (a literal address is
    checked as an address: metadata, private, mapped and decimal forms are canonical literals by then)."""
    request = _url_request(value) if len(value) <= _MAX_URL else "bad_url:too_long"
    if isinstance(request, str):
        return request
    state = facts.network_state or SandboxState(sandbox_id=facts.sandbox_id, admitted_at=now, labels=facts.labels)
    verdict = decide(policy, request, state, now)
    return None if verdict.allowed else str(verdict.reason)


def _deny(
    policy: CompiledPolicy, call: ToolCall, reason: Reason, rule_id: str | None, *, detail: str | None = None,
    argument: str | None = None, approval_kind: str | None = None,
) -> ToolDecision:
    message = mcp_message(policy, reason, call.server, call.tool, rule_id=rule_id, detail=detail,
                          argument=argument)
    return ToolDecision("deny", reason, rule_id, message, (), approval_kind, argument, detail)
