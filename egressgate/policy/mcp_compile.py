"""Compile the `mcp:` section into lookup tables the tool-call decision reads (mcp_decide.py).

Everything a decision needs is resolved here once: regexes compiled, the server's URL canonicalized (the
same policy.target.parse_url the gateway's requests go through, so a route lookup is an exact tuple
match), rule ids filled in. Whatever is wrong but not a schema error is a load error with its key path:
duplicate server names or URLs, a server that is both remote and local, a URL no network allow rule lets
the sandbox reach (an MCP server is reached ONLY through an allowed network rule), a bad regex, `min >
max`, a constraint that cannot apply to the declared type, a pin for a tool the policy does not allow.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from egressgate.policy.canon import CanonError
from egressgate.policy.mcp_model import ArgumentConstraint, McpSection, McpServerModel, ToolAllow
from egressgate.policy.mcp_path import PathRefused, canon_tool_path
from egressgate.policy.readings import AmbiguousPath, fold, server_readings
from egressgate.policy.reasons import Effect
from egressgate.policy.target import parse_url

if TYPE_CHECKING:
    from egressgate.policy.compile import CompiledPolicy, CompiledRule

MAX_SERVERS = 256
MAX_TOOLS_PER_SERVER = 1024  # allow + deny entries
MAX_ARGUMENTS_PER_TOOL = 256
MAX_PATTERN_CHARS = 1024
_STRING_ONLY = ("pattern", "max_length", "path_prefix", "equals_label", "allowed_by_network")


@dataclass(frozen=True, slots=True)
class McpArgument:
    name: str
    type: str | None
    enum: tuple[object, ...] | None
    pattern: re.Pattern[str] | None
    min: int | float | None
    max: int | float | None
    max_length: int | None
    path_prefix: str | None  # canonical, without a trailing '/' ('' for '/')
    allowed_by_network: bool
    equals_label: str | None
    required: bool

    @property
    def needs_string(self) -> bool:
        return bool(self.pattern or self.max_length is not None or self.path_prefix is not None
                    or self.equals_label or self.allowed_by_network)


@dataclass(frozen=True, slots=True)
class McpTool:
    name: str
    rule_id: str
    budget_calls: int | None
    approval_required: bool
    unlisted_allowed: bool
    arguments: Mapping[str, McpArgument]
    key_path: str


@dataclass(frozen=True, slots=True)
class McpServer:
    name: str
    key_path: str
    local: bool
    transport: str | None  # "streamable_http" | "sse" for remote servers, None for local ones
    scheme: str | None  # remote: the canonical URL parts
    host: str | None
    port: int | None
    path: str | None
    server_info: tuple[str, str] | None  # pinned (name, version)
    tool_schemas: Mapping[str, str]  # tool -> pinned sha256 hex
    trust_on_first_use: bool
    budget_calls: int | None
    allowed: Mapping[str, McpTool]
    denied: Mapping[str, str]  # tool -> rule id of its deny entry

    @property
    def url(self) -> str | None:
        if self.host is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"

    def serves_path(self, path: str) -> bool:
        """Is a request to this canonical path (on the server's origin) part of the MCP route? The old SSE
        transport POSTs to an endpoint the server picks, so every path of its origin is. A streamable HTTP
        endpoint covers its path and everything under it (`/mcp`, `/mcp/`, `/mcp/x`) and every spelling a
        server may read as one of those (policy/readings.py: `//mcp`, `/MCP`, `/mcp;x`, `/mcp.json`,
        `/a%2Fmcp`...), else a tools/call would reach the server unmediated under another spelling. A path
        whose readings cannot be modelled is an MCP route too: it is then parsed strictly, never waved on."""
        if self.transport == "sse":
            return True
        assert self.path is not None
        if _under(path, self.path):
            return True
        try:
            readings = server_readings(path)
        except AmbiguousPath:
            return True
        folded = fold(self.path)
        return any(_under(r, self.path) or _under(r, folded) for r in readings)


def _under(path: str, base: str) -> bool:
    base = base.rstrip("/")
    return path == base or path.startswith(base + "/") or (not base and path == "/")


@dataclass(frozen=True, slots=True)
class CompiledMcp:
    record_arguments: bool
    max_message_bytes: int
    servers: Mapping[str, McpServer]
    by_origin: Mapping[tuple[str, str, int], tuple[McpServer, ...]]


EMPTY_MCP = CompiledMcp(False, McpSection().max_message_bytes, MappingProxyType({}), MappingProxyType({}))


def compile_mcp(section: McpSection, policy: CompiledPolicy, problems: list[tuple[str, str]]) -> CompiledMcp:
    if section == McpSection():
        return EMPTY_MCP
    if len(section.servers) > MAX_SERVERS:
        problems.append(("mcp.servers", f"{len(section.servers)} servers; at most {MAX_SERVERS}"))
        return EMPTY_MCP
    servers: dict[str, McpServer] = {}
    by_origin: dict[tuple[str, str, int], list[McpServer]] = {}
    seen_names: dict[str, str] = {}
    seen_urls: dict[str, str] = {}
    rule_ids = {r.id: r.key_path for r in policy.rules}
    for rule in policy.rules:  # MCP call counters share the state store's rule-usage keys: `mcp:<server>[/<tool>]`
        if rule.id.startswith("mcp:"):
            problems.append((f"{rule.key_path}.id", "ids starting with 'mcp:' are reserved for MCP call budgets"))
    for i, raw in enumerate(section.servers):
        where = f"mcp.servers[{i}]"
        if raw.name in seen_names:
            problems.append((f"{where}.name", f"duplicate server name {raw.name!r} (also {seen_names[raw.name]})"))
            continue
        seen_names[raw.name] = where
        server = _server(raw, where, policy, rule_ids, problems)
        if server is None:
            continue
        if server.url is not None:
            if server.url in seen_urls:
                problems.append((f"{where}.url", f"{server.url} is also the url of {seen_urls[server.url]}"))
                continue
            seen_urls[server.url] = where
            assert server.scheme and server.host and server.port
            same_origin = by_origin.setdefault((server.scheme, server.host, server.port), [])
            other = next((o for o in same_origin if _routes_overlap(o, server)), None)
            if other is not None:
                problems.append((f"{where}.url", f"its MCP route overlaps that of {other.key_path} ({other.url}): a "
                                 "request there could not be told apart, and would be decided by the other "
                                 "server's tools; give each server its own origin or disjoint paths"))
                continue
            same_origin.append(server)
        servers[server.name] = server
    return CompiledMcp(
        record_arguments=section.record_arguments,
        max_message_bytes=section.max_message_bytes,
        servers=MappingProxyType(servers),
        # streamable routes first: an `sse` server's route (its whole origin) only gets what none covers
        by_origin=MappingProxyType({k: tuple(sorted(v, key=lambda s: s.transport == "sse"))
                                    for k, v in by_origin.items()}),
    )


def _server(
    raw: McpServerModel,
    where: str,
    policy: CompiledPolicy,
    rule_ids: dict[str, str],
    problems: list[tuple[str, str]],
) -> McpServer | None:
    before = len(problems)
    scheme = host = path = None
    port = None
    if (raw.url is None) == (not raw.local):
        problems.append((where, "set exactly one of `url` (a remote server) or `local: true`"))
    elif raw.url is not None:
        try:
            url = parse_url(raw.url)
        except CanonError as exc:
            problems.append((f"{where}.url", f"not a usable URL: {exc}"))
        else:
            if url.query:
                problems.append((f"{where}.url", "remove the query string: the endpoint is matched by path"))
            scheme, host, port, path = url.scheme, url.host, url.port, url.path
            if not _network_allows(policy, scheme, host, port, path):
                problems.append((f"{where}.url", f"no network.{scheme} allow rule lets the sandbox reach "
                                 f"{raw.url}; an MCP server is reached only through an allowed network rule"))
            splicing = _splicing_rule(policy, host, port)
            if splicing is not None:
                problems.append((f"{where}.url", f"passthrough rule {splicing.id!r} ({splicing.key_path}) splices "
                                 f"tunnels to {host}:{port} unread, so this server's tool calls could not be "
                                 "decided; drop its `tls: passthrough` or narrow its host"))
    if raw.local and raw.transport is not None:
        problems.append((f"{where}.transport", "a local server speaks stdio; `transport` is for `url` servers"))
    total = len(raw.tools.allow) + len(raw.tools.deny)
    if total > MAX_TOOLS_PER_SERVER:
        problems.append((f"{where}.tools", f"{total} tools; at most {MAX_TOOLS_PER_SERVER} per server"))
        return None
    allowed: dict[str, McpTool] = {}
    names: set[str] = set()
    for j, tool in enumerate(raw.tools.allow):
        if tool.name in names:
            problems.append((f"{where}.tools.allow[{j}].name", f"tool {tool.name!r} is listed twice"))
            continue
        names.add(tool.name)
        compiled = _tool(raw.name, tool, f"{where}.tools.allow[{j}]", rule_ids, problems)
        if compiled is not None:
            allowed[compiled.name] = compiled
    denied: dict[str, str] = {}
    for j, name in enumerate(raw.tools.deny):
        denied.setdefault(name, f"mcp:{raw.name}/deny[{j}]")
    for tool in raw.tool_schemas:
        if tool not in allowed:
            problems.append((f"{where}.tool_schemas.{tool}", "a pin for a tool not in tools.allow (check the name)"))
    if len(problems) > before:
        return None
    return McpServer(
        name=raw.name, key_path=where, local=raw.local,
        transport=(raw.transport or "streamable_http") if raw.url is not None else None,
        scheme=scheme, host=host, port=port, path=path,
        server_info=(raw.server_info.name, raw.server_info.version) if raw.server_info else None,
        tool_schemas=MappingProxyType(dict(raw.tool_schemas)),
        trust_on_first_use=raw.trust_on_first_use,
        budget_calls=raw.budget.calls if raw.budget else None,
        allowed=MappingProxyType(allowed), denied=MappingProxyType(denied),
    )


def _network_allows(policy: CompiledPolicy, scheme: str, host: str, port: int, path: str) -> bool:
    """Static: some allow rule of the URL's scheme matches its host, port and path (conditions and budgets
    are decided per request, by the gateway, like for any route)."""
    return any(
        (rule.ports is None or port in rule.ports) and rule.path_allows(path)
        for rule in policy.candidates(scheme, Effect.ALLOW, host)
    )


def _routes_overlap(a: McpServer, b: McpServer) -> bool:
    """Two servers of one origin whose routes cannot be told apart: two streamable servers one of whose
    routes covers the other's path (in every spelling), or two `sse` servers (each route is the whole
    origin). mcp_server_for would hand such a request to the one listed first, so `/mcp/admin` of a
    stricter server would be decided by `/mcp`'s tool rules (a same-named tool, the other server's
    constraints and pins). A streamable server and an `sse` one may share an origin: the streamable
    routes are looked up first (compile_mcp orders them), the `sse` server gets the rest."""
    assert a.path is not None and b.path is not None
    if a.transport == "sse" or b.transport == "sse":
        return a.transport == b.transport
    return a.serves_path(b.path) or b.serves_path(a.path)


def _splicing_rule(policy: CompiledPolicy, host: str, port: int) -> CompiledRule | None:
    """A `tls: passthrough` allow rule covering the server's host and port, or None. Such a tunnel is
    spliced unread: no tools/call in it can be parsed, decided or recorded, so the `mcp` entry would only
    look enforced. Conservative (like passthrough.py): rule order and `when` are ignored."""
    for rule in policy.rules:
        if (rule.passthrough and rule.effect is Effect.ALLOW and rule.host.matches(host)
                and (rule.ports is None or port in rule.ports)
                and not any(p.matches(host) for p in rule.except_hosts)):
            return rule
    return None


def _tool(
    server: str, raw: ToolAllow, where: str, rule_ids: dict[str, str], problems: list[tuple[str, str]]
) -> McpTool | None:
    before = len(problems)
    rule_id = raw.id or f"mcp:{server}/{raw.name}"
    if rule_id in rule_ids:
        problems.append((f"{where}.id", f"duplicate rule id {rule_id!r} (also {rule_ids[rule_id]})"))
    rule_ids[rule_id] = where
    if len(raw.arguments) > MAX_ARGUMENTS_PER_TOOL:
        problems.append((f"{where}.arguments", f"{len(raw.arguments)} arguments; at most {MAX_ARGUMENTS_PER_TOOL}"))
        return None
    arguments = {}
    for name, constraint in raw.arguments.items():
        argument = _argument(name, constraint, f"{where}.arguments.{name}", problems)
        if argument is not None:
            arguments[name] = argument
    if len(problems) > before:
        return None
    return McpTool(
        name=raw.name, rule_id=rule_id, budget_calls=raw.budget.calls if raw.budget else None,
        approval_required=raw.approval == "required", unlisted_allowed=raw.unlisted_arguments == "allow",
        arguments=MappingProxyType(arguments), key_path=where,
    )


def _argument(
    name: str, raw: ArgumentConstraint, where: str, problems: list[tuple[str, str]]
) -> McpArgument | None:
    before = len(problems)
    pattern = None
    if raw.pattern is not None:
        if len(raw.pattern) > MAX_PATTERN_CHARS:
            problems.append((f"{where}.pattern", f"longer than {MAX_PATTERN_CHARS} characters"))
        else:
            try:
                pattern = re.compile(raw.pattern)
            except re.error as exc:
                problems.append((f"{where}.pattern", f"not a valid regular expression: {exc}"))
    string_checks = [key for key in _STRING_ONLY if getattr(raw, key) not in (None, False)]
    if string_checks and raw.type not in (None, "string"):
        problems.append((f"{where}.{string_checks[0]}", f"applies to strings, but type is {raw.type!r}"))
    if (raw.min is not None or raw.max is not None) and raw.type not in (None, "integer", "number"):
        problems.append((f"{where}.{'min' if raw.min is not None else 'max'}",
                         f"applies to numbers, but type is {raw.type!r}"))
    if string_checks and (raw.min is not None or raw.max is not None):
        problems.append((where, f"{string_checks[0]} (strings) and min/max (numbers) can never both hold"))
    if raw.min is not None and raw.max is not None and raw.min > raw.max:
        problems.append((f"{where}.min", f"min {raw.min} is greater than max {raw.max}: nothing passes"))
    for key in ("min", "max"):
        value = getattr(raw, key)
        if isinstance(value, float) and not math.isfinite(value):
            problems.append((f"{where}.{key}", "must be a finite number"))
    if raw.enum is not None and not raw.enum:
        problems.append((f"{where}.enum", "an empty enum matches nothing; remove the argument or list values"))
    prefix = None
    if raw.path_prefix is not None:
        try:
            prefix = canon_tool_path(raw.path_prefix).rstrip("/")
        except PathRefused as exc:
            problems.append((f"{where}.path_prefix", f"not an absolute plain path ({exc.code})"))
    if len(problems) > before:
        return None
    return McpArgument(
        name=name, type=raw.type, enum=tuple(raw.enum) if raw.enum is not None else None, pattern=pattern,
        min=raw.min, max=raw.max, max_length=raw.max_length, path_prefix=prefix,
        allowed_by_network=raw.allowed_by_network, equals_label=raw.equals_label, required=raw.required,
    )
