"""The one sentence a denied agent reads.

Agents that get a bare 403 retry around the proxy; a sentence that says what *is* allowed stops that.
Messages name the policy's own hosts, methods and paths (the agent may know them) but never resolved
addresses (internal DNS would leak) nor anything credential-related.
"""

from __future__ import annotations

import weakref

from egressgate.policy.compile import CompiledPolicy, CompiledRule
from egressgate.policy.facts import Facts, Operation
from egressgate.policy.reasons import Effect, Reason

_MAX_LISTED = 8
AMBIGUOUS_PATH_HINTS = {  # path_ambiguous detail (policy.readings.AmbiguousPath.code) -> what to do
    "invalid_utf8": "percent-encode non-ASCII characters as UTF-8",
    "control_char": "remove control characters and NUL (also percent-encoded ones)",
    "short_name": "use the full file or directory name, not a Windows 8.3 short name",
    "too_long": "shorten the path or send it in plain form (lower-case, no escapes or ';')",
    "too_many_readings": "use at most one level of percent-encoding and no ';' parameters",
}


def _target(facts: Facts) -> str:
    if facts.operation is Operation.DNS_QUERY:
        return f"{facts.qtype} {facts.host}"
    if facts.operation is Operation.CONNECT:
        return f"{facts.host}:{facts.port}"
    return f"{facts.method} {facts.scheme}://{facts.host}{facts.path or '/'}"


def _listing(items: list[str]) -> str:
    if not items:
        return "none"
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


_HOST_LISTINGS: weakref.WeakKeyDictionary[CompiledPolicy, str] = weakref.WeakKeyDictionary()


def _host_listing(policy: CompiledPolicy) -> str:
    """Computed once per policy: a deny must not cost a sort of every rule's host."""
    listing = _HOST_LISTINGS.get(policy)
    if listing is None:
        hosts = sorted({*policy.allowed_hosts("https"), *policy.allowed_hosts("http")})
        listing = _HOST_LISTINGS[policy] = _listing(hosts)
    return listing


def _rules_for(policy: CompiledPolicy, facts: Facts) -> list[CompiledRule]:
    schemes = (facts.scheme,) if facts.scheme in ("https", "http", "tcp") else ("https", "http", "tcp")
    return [r for s in schemes for r in policy.candidates(s, Effect.ALLOW, facts.host)]


def deny_message(
    policy: CompiledPolicy, facts: Facts, reason: Reason, rule: CompiledRule | None, detail: str | None
) -> str:
    target = _target(facts)
    name = policy.name
    if reason is Reason.METADATA_ENDPOINT:
        return (f"{target} is a cloud metadata endpoint; sandboxes can never reach it. "
                "Ask the operator for a brokered credential instead.")
    if reason is Reason.ADDRESS_FORBIDDEN:
        return (f"{facts.host} is (or resolves to) a {detail} address; egress to non-public addresses is "
                f"refused unless policy {name!r} lists them in network.allow_private.")
    if reason is Reason.BUDGET_EXCEEDED:
        what = f"rule {rule.id!r}" if rule else (detail or "the sandbox")
        return f"The budget of {what} in policy {name!r} is spent; further requests are refused."
    if reason is Reason.QTYPE_NOT_ALLOWED:
        return (f"DNS {facts.qtype} queries are not allowed; allowed types: "
                f"{_listing(sorted(policy.dns.query_types))}.")
    if reason is Reason.DENIED_BY_RULE:
        return f"{target} is explicitly denied by rule {rule.id if rule else '?'!r} of policy {name!r}."
    if reason is Reason.PATH_AMBIGUOUS:
        hint = AMBIGUOUS_PATH_HINTS.get(detail or "", "send the path in plain form")
        return (f"{target} is refused: rule {rule.id if rule else '?'!r} of policy {name!r} denies some paths "
                f"on {facts.host}, and servers can read this path ({detail}) in ways that cannot be checked; "
                f"{hint}.")
    if reason is Reason.PACKAGE_INSTALL_DENIED:
        return (f"{target} is a package install ({detail or facts.op_protocol or 'package manager'}) and policy "
                f"{name!r} does not allow package installs (execution.package_install: deny) from any index or "
                "mirror; use the dependencies already in the sandbox or ask the operator to change the policy.")
    if reason is Reason.APPROVAL_REQUIRED and detail in ("package_install", "publish"):
        what = "a package install" if detail == "package_install" else "a publish"
        return (f"{target} is {what} ({facts.op_protocol or '?'}) and policy {name!r} requires an operator's "
                "approval for it; retry this request after an operator approves it.")
    if reason is Reason.APPROVAL_REQUIRED:  # the gateway names the approval (gateway/shared/approval_gate.py)
        return (f"{target} is outside the allowlist of policy {name!r} and needs an operator's approval; do not "
                "route around the gateway: retry this request after an operator approves it.")
    if reason is Reason.HOST_NOT_ALLOWED:
        if facts.operation is Operation.DNS_QUERY:
            return f"{facts.host} is not in policy {name!r}'s DNS allowlist; only listed names resolve."
        return (f"{facts.host} is not allowed by policy {name!r}; allowed hosts: {_host_listing(policy)}. "
                "Do not retry through another route: all egress goes through this gateway.")
    if reason is Reason.SCHEME_NOT_ALLOWED:
        schemes = sorted({r.scheme for r in _rules_for(policy, Facts(facts.operation, facts.host))})
        return (f"{facts.scheme or 'this protocol'} to {facts.host} is not allowed; use the scheme the policy "
                f"allows ({_listing(schemes)}).")
    rules = _rules_for(policy, facts)
    if reason is Reason.PORT_NOT_ALLOWED:
        ports = sorted({p for r in rules for p in (r.ports or ())})
        return f"Port {facts.port} on {facts.host} is not allowed; allowed ports: {_listing([str(p) for p in ports])}."
    if reason in (Reason.METHOD_NOT_ALLOWED, Reason.PATH_NOT_ALLOWED):
        allowed = sorted({r.describe() for r in rules})
        return f"{target} is not allowed by policy {name!r}; on {facts.host} it allows: {_listing(allowed)}."
    if reason is Reason.CONDITION_FAILED:
        return (f"{target} matches rule {rule.id if rule else '?'!r} but its conditions (labels, time since "
                "admission or earlier requests) do not hold for this sandbox now.")
    return f"{target} is not allowed by policy {name!r} ({reason.value})."


# --- MCP tool calls (policy/mcp_decide.py) -----------------------------------------------------------

_ARGUMENT_HINTS = {
    "missing": "it is required",
    "unlisted": "this tool accepts only the arguments the policy lists",
    "type": "it has the wrong JSON type",
    "enum": "it is not one of the allowed values",
    "pattern": "it does not match the allowed pattern",
    "min": "it is below the minimum",
    "max": "it is above the maximum",
    "max_length": "it is too long",
    "path_prefix": "the path is outside the allowed directory",
    "label_missing": "this sandbox has no label to compare it with",
    "label_mismatch": "it must be this sandbox's own identifier",
    "not_object": "arguments must be a JSON object",
}
_PATH_HINT = "use a plain absolute path without '..', '//', '%', backslashes, control or look-alike characters"


def _shown(name: object) -> str:
    """Agent-supplied names are echoed bounded and printable (a tool name can be any JSON value)."""
    original = name if isinstance(name, str) else "?"
    if len(original) <= 64 and original.isprintable():
        return repr(original)
    text = "".join(c if c.isprintable() else "?" for c in original[:64])
    return repr(text + ("..." if len(original) > 64 else ""))


def _argument_hint(policy: CompiledPolicy, server: str, tool: str, argument: str | None, detail: str) -> str:
    compiled = policy.mcp.servers.get(server)
    spec = compiled.allowed[tool].arguments.get(argument or "") if compiled and tool in compiled.allowed else None
    if detail.startswith("path:"):
        return _PATH_HINT
    if detail.startswith("network:"):
        return f"it is a URL or host this sandbox may not reach ({detail.removeprefix('network:')})"
    hint = _ARGUMENT_HINTS.get(detail, detail)
    if spec is not None and detail == "path_prefix":
        hint += f" ({spec.path_prefix or ''}/...)"
    elif spec is not None and detail in ("min", "max"):
        low, high = ("-inf" if spec.min is None else spec.min), ("inf" if spec.max is None else spec.max)
        hint += f" (allowed: {low} to {high})"
    elif spec is not None and detail == "enum" and spec.enum is not None:
        hint += f" ({_listing([str(v) for v in spec.enum])})"
    elif spec is not None and detail == "max_length":
        hint += f" (at most {spec.max_length} characters)"
    return hint


def mcp_message(
    policy: CompiledPolicy, reason: Reason, server: str, tool: str | None, *, rule_id: str | None = None,
    detail: str | None = None, argument: str | None = None,
) -> str:
    """The one sentence of an MCP denial (the JSON-RPC error's `message`). Never contains argument values."""
    name, srv, what = policy.name, _shown(server), f"Tool {_shown(tool)} of MCP server {_shown(server)}"
    if reason is Reason.MCP_TOOL_DENIED:
        if detail == "unknown_server":
            return f"MCP server {srv} is not in policy {name!r}; only the servers it lists can be used."
        if rule_id is not None:
            return f"{what} is denied by rule {rule_id!r} of policy {name!r}; do not retry it."
        return f"{what} is not allowed by policy {name!r}; call only the tools tools/list shows."
    if reason is Reason.MCP_ARGUMENT_DENIED:
        hint = _argument_hint(policy, server, tool or "", argument, detail or "")
        return f"Argument {_shown(argument)} of tool {_shown(tool)} is refused by policy {name!r}: {hint}."
    if reason is Reason.MCP_SCHEMA_DRIFT:
        if detail == "tool_schema_unseen":
            return f"{what} is pinned to a reviewed schema; list the tools (tools/list) in this session first."
        return (f"{what} changed its schema since it was reviewed; calls to it are refused until an operator "
                "updates its pin.")
    if reason is Reason.MCP_SERVER_CHANGED:
        if detail == "server_info_unseen":
            return f"MCP server {srv} is pinned to a version; initialize the session through the gateway first."
        return (f"MCP server {srv} reports another name or version than the reviewed one; its tools are refused "
                "until an operator updates the pin.")
    if reason is Reason.BUDGET_EXCEEDED:
        return f"The call budget {detail or '?'!r} of policy {name!r} is spent; further calls are refused."
    if reason is Reason.APPROVAL_REQUIRED:
        return f"{what} needs an operator's approval; retry this call after an operator approves it."
    if reason is Reason.MCP_MALFORMED:
        return (f"The MCP message was refused whole: it is not strict JSON-RPC 2.0 ({detail or 'malformed'}); "
                "send well-formed UTF-8 JSON without duplicate keys, within the size and depth limits.")
    if reason is Reason.MCP_LOCAL_DENIED:
        if detail == "execution_denied":
            return f"Policy {name!r} does not allow local MCP servers (execution.local_mcp_servers: deny)."
        return f"{srv} is not a local MCP server of policy {name!r}; it must be listed with `local: true`."
    return f"{what} is refused by policy {name!r} ({reason.value})."
