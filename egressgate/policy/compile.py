"""Compile a validated policy model into indexed matchers.

Per request the engine must not scan rules: each (scheme, effect) has an exact-host dict and a
wildcard-suffix dict, and a lookup walks only the labels of the requested host. Everything that can be
wrong with a policy but is not a schema error (bad globs, non-canonical hosts, credential bindings that
overlap or point at wildcards, budgets without ids) is rejected here with the key path of the culprit.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from egressgate.policy import querymatch
from egressgate.policy.canon import CanonError, canon_method, parse_ip_literal
from egressgate.policy.errors import PolicyError
from egressgate.policy.execution import approval_kinds
from egressgate.policy.facts import RuleUsage, SandboxState
from egressgate.policy.filesystem import filesystem_problems
from egressgate.policy.globs import (
    DenyGlob,
    GlobError,
    HostPattern,
    PathGlob,
    deny_glob,
    parse_host_pattern,
    parse_path_glob,
)
from egressgate.policy.mcp_compile import EMPTY_MCP, CompiledMcp, compile_mcp
from egressgate.policy.model import Budget, Conditions, HttpRule, Policy, TcpRule
from egressgate.policy.passthrough import passthrough_problems, tls_problems
from egressgate.policy.persistence import persistence_problems
from egressgate.policy.reasons import Effect

DEFAULT_PORTS = {"https": (443,), "http": (80,)}
SCHEMES = ("https", "http", "tcp")
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_NO_USAGE = RuleUsage()  # a budgeted rule the sandbox never used (relevant_state)


@dataclass(frozen=True, slots=True)
class CompiledConditions:
    labels: tuple[tuple[str, frozenset[str]], ...] = ()
    sandbox_ids: frozenset[str] | None = None
    within_seconds: int | None = None
    after_seconds: int | None = None
    after_request_to: tuple[HostPattern, ...] | None = None
    unless_request_to: tuple[HostPattern, ...] | None = None


@dataclass(frozen=True, slots=True)
class CompiledRule:
    id: str
    index: int  # global position in the file: earlier rules win
    scheme: str
    effect: Effect
    host: HostPattern
    except_hosts: tuple[HostPattern, ...]
    ports: frozenset[int] | None  # None = every port (a deny rule without `ports`)
    methods: frozenset[str] | None  # None = any method
    paths: tuple[PathGlob, ...] | None  # None = any path
    credential: str | None
    when: CompiledConditions | None
    budget: Budget | None
    key_path: str = ""  # where the rule is in the file, for error messages
    # Deny rules only: `paths` widened to fail closed against every server reading (policy.readings).
    deny_paths: tuple[DenyGlob, ...] | None = None
    passthrough: bool = False  # an https allow rule with `tls: passthrough`: its tunnels are spliced
    query: querymatch.QueryMatcher | None = None  # `query:` (policy/querymatch.py); None = any query

    def path_allows(self, path: str | None) -> bool:
        return self.paths is None or (path is not None and any(glob.matches(path) for glob in self.paths))

    def describe(self) -> str:
        methods = ",".join(sorted(self.methods)) if self.methods else "any method"
        paths = " ".join(g.source for g in self.paths) if self.paths else "any path"
        return f"{methods} {paths}" + (f"?{self.query.describe()}" if self.query is not None else "")


@dataclass(slots=True)
class RuleIndex:
    exact: dict[str, list[CompiledRule]] = field(default_factory=dict)
    suffix: dict[str, list[CompiledRule]] = field(default_factory=dict)
    anywhere: list[CompiledRule] = field(default_factory=list)

    def add(self, rule: CompiledRule) -> None:
        if rule.host.kind == "exact":
            self.exact.setdefault(rule.host.value, []).append(rule)
        elif rule.host.kind == "suffix":
            self.suffix.setdefault(rule.host.value, []).append(rule)
        else:
            self.anywhere.append(rule)

    def candidates(self, host: str) -> list[CompiledRule]:
        """Rules whose host pattern matches `host`, in file order. O(labels of host)."""
        found = list(self.exact.get(host, ()))
        if self.suffix and parse_ip_literal(host) is None:
            rest = host
            while "." in rest:
                rest = rest.split(".", 1)[1]
                found.extend(self.suffix.get(rest, ()))
        found.extend(self.anywhere)
        if len(found) > 1:
            found.sort(key=lambda r: r.index)
        return [r for r in found if not any(p.matches(host) for p in r.except_hosts)]

    def hosts(self) -> list[str]:
        return [*self.exact, *(f"*.{s}" for s in self.suffix)]


@dataclass(frozen=True, slots=True)
class DnsSettings:
    allow: tuple[HostPattern, ...]
    deny_rcode: str
    query_types: frozenset[str]
    max_queries: int | None
    max_name_bytes: int | None
    rate_per_second: float | None
    deny_answer: str = "gateway"  # network.dns.deny_answer (dns/gateway_answer.py)


class CompiledPolicy:
    """An immutable, indexed policy. `hash` identifies its content in audit records."""

    def __init__(self, model: Policy, source: str, policy_hash: str) -> None:
        self.model = model
        self.source = source
        self.hash = policy_hash
        self.name = model.sandbox.name
        self.outbound_bytes_max = model.sandbox.resources.outbound_bytes_max
        self.capabilities: dict[str, Any] = dict(model.credentials.capabilities)
        self.allow_private: tuple[IPNetwork, ...] = ()
        self.rules: list[CompiledRule] = []
        self.index: dict[tuple[str, Effect], RuleIndex] = {
            (scheme, effect): RuleIndex() for scheme in SCHEMES for effect in Effect
        }
        self._dns_index = RuleIndex()
        self.dns: DnsSettings
        self.history_patterns: tuple[HostPattern, ...] = ()  # hosts any `when` asks the history about
        self.history_scope: tuple[str, ...] | None = None  # the same as text (SandboxState.seen_scope); None: none
        self.budgeted_rules: frozenset[str] = frozenset()  # rules whose usage decide() reads
        self.has_passthrough = False  # some rule has `tls: passthrough` (transparent.py peeks at SNI first)
        self.approval_kinds: frozenset[str] = frozenset()  # execution.require_approval_for (policy/execution.py)
        self.package_install: str = model.execution.package_install  # allow | deny | approval (policy/opclass.py)
        self.mcp: CompiledMcp = EMPTY_MCP  # the `mcp:` section (policy/mcp_compile.py)

    def relevant_state(self, state: SandboxState) -> SandboxState:
        """`state` reduced to what decide() can read under this policy: only history hosts some `when`
        asks about, only the usage of rules with a budget. decide() gives the same answer for both; the
        audit trail records this one, so a record's size does not grow with everything the sandbox ever
        did (a wildcard rule would otherwise let a sandbox inflate every later record)."""
        hosts = state.seen_hosts
        if hosts and self.history_patterns:
            hosts = frozenset(h for h in hosts if any(p.matches(h) for p in self.history_patterns))
        elif hosts:
            hosts = frozenset()
        # Every budgeted rule's usage, a rule never used as zero: "this rule had 0 requests" is a fact the
        # decision used, and `audit replay` must read it from the record rather than count the rule's
        # uses in the log (concurrent requests all decided on 0 before any was counted; issue 23 item 1).
        usage = state.rule_usage
        if self.budgeted_rules:
            if usage.keys() != self.budgeted_rules:
                usage = MappingProxyType({r: usage.get(r) or _NO_USAGE for r in sorted(self.budgeted_rules)})
        elif usage:
            usage = MappingProxyType({})
        # Which hosts `hosts` answers for (SandboxState.seen_scope, recorded with it): `audit replay` takes
        # exactly the recorded answer for those (a host another request added after this snapshot, logged
        # before this decision's record, was not seen by it) and the log's history for any other host.
        scope = self.history_scope
        unchanged = hosts is state.seen_hosts and usage is state.rule_usage and state.seen_scope == scope
        return state if unchanged else replace(state, seen_hosts=hosts, rule_usage=usage, seen_scope=scope)

    def candidates(self, scheme: str, effect: Effect, host: str) -> list[CompiledRule]:
        return self.index[(scheme, effect)].candidates(host)

    def dns_name_allowed(self, host: str) -> CompiledRule | None:
        """The dns.allow entry or allow rule that makes `host` resolvable (None: not resolvable)."""
        found = self._dns_index.candidates(host)
        return found[0] if found else None

    def allowed_hosts(self, scheme: str) -> list[str]:
        return self.index[(scheme, Effect.ALLOW)].hosts()


def compile_policy(model: Policy, source: str, policy_hash: str) -> CompiledPolicy:
    policy = CompiledPolicy(model, source, policy_hash)
    problems: list[tuple[str, str]] = []
    net = model.network
    for i, cidr in enumerate(net.allow_private):
        try:
            network = ipaddress.ip_network(cidr, strict=True)
        except ValueError as exc:
            problems.append((f"network.allow_private[{i}]", f"not a CIDR network: {exc}"))
            continue
        policy.allow_private += (network,)

    counter = 0
    seen_ids: dict[str, str] = {}
    for scheme in SCHEMES:
        section = getattr(net, scheme)
        for effect in (Effect.DENY, Effect.ALLOW):
            for i, raw in enumerate(getattr(section, effect.value)):
                path = f"network.{scheme}.{effect.value}[{i}]"
                rule = _compile_rule(raw, scheme, effect, counter, path, policy, problems)
                counter += 1
                if rule is None:
                    continue
                if rule.id in seen_ids:
                    problems.append((f"{path}.id", f"duplicate rule id {rule.id!r} (also {seen_ids[rule.id]})"))
                seen_ids[rule.id] = path
                policy.rules.append(rule)
                policy.index[(scheme, effect)].add(rule)
                if effect is Effect.ALLOW:
                    policy._dns_index.add(rule)

    policy.dns = _compile_dns(model, policy, problems)
    policy.history_patterns = tuple(
        p for r in policy.rules if r.when is not None
        for p in (*(r.when.after_request_to or ()), *(r.when.unless_request_to or ()))
    )
    policy.history_scope = tuple(sorted({str(p) for p in policy.history_patterns})) or None
    policy.budgeted_rules = frozenset(r.id for r in policy.rules if r.budget is not None)
    policy.has_passthrough = any(r.passthrough for r in policy.rules)
    policy.approval_kinds = approval_kinds(model.execution, problems)
    policy.mcp = compile_mcp(model.mcp, policy, problems)
    problems.extend((*_credential_problems(policy), *passthrough_problems(policy), *filesystem_problems(model)))
    ws = model.sandbox.workspace
    problems.extend(persistence_problems(model.persistence, ws.path if ws else None, bool(ws and ws.persistent)))
    if problems:
        raise PolicyError(source, problems)
    return policy


def _compile_rule(
    raw: HttpRule | TcpRule,
    scheme: str,
    effect: Effect,
    counter: int,
    path: str,
    policy: CompiledPolicy,
    problems: list[tuple[str, str]],
) -> CompiledRule | None:
    before = len(problems)
    host = _host(raw.host, f"{path}.host", effect is Effect.DENY, problems)
    excepts = tuple(
        p
        for j, h in enumerate(raw.except_hosts)
        if (p := _host(h, f"{path}.except_hosts[{j}]", False, problems)) is not None
    )
    if raw.except_hosts and host is not None and host.kind == "exact":
        problems.append((f"{path}.except_hosts", "except_hosts only makes sense with a wildcard host"))
    methods = paths = credential = query = None
    if isinstance(raw, HttpRule):
        if raw.query is not None:
            query = querymatch.compile_query(raw.query, f"{path}.query", problems)
        if raw.methods is not None:
            methods = frozenset(_methods(raw.methods, f"{path}.methods", problems))
            if not raw.methods:
                problems.append((f"{path}.methods", "an empty method list matches nothing; omit it for any"))
        if raw.paths is not None:
            paths = tuple(_paths(raw.paths, f"{path}.paths", problems))
            if not raw.paths:
                problems.append((f"{path}.paths", "an empty path list matches nothing; omit it for any"))
        credential = raw.credential
        if credential is not None:
            if effect is Effect.DENY:
                problems.append((f"{path}.credential", "deny rules cannot carry a credential"))
            elif scheme != "https":
                problems.append((f"{path}.credential", "credentials are injected on HTTPS rules only"))
            elif host is not None and host.kind != "exact":
                problems.append((f"{path}.credential", "a credential needs one exact host (its audience)"))
            if methods and "TRACE" in methods:
                problems.append((f"{path}.methods", "TRACE is never allowed with a credential (it echoes it back)"))
            if credential not in policy.capabilities:
                problems.append((f"{path}.credential", f"unknown capability {credential!r} (define it in "
                                 "credentials.capabilities)"))
    if raw.budget is not None and effect is Effect.DENY:
        problems.append((f"{path}.budget", "budgets belong on allow rules"))
    problems.extend(tls_problems(raw, scheme, effect, path))  # `tls:`, and budgets of relayed tunnels
    when = _conditions(raw.when, f"{path}.when", problems) if raw.when is not None else None
    ports = _ports(raw.ports, scheme, effect)
    if len(problems) > before or host is None:
        return None
    return CompiledRule(
        id=raw.id or path.removeprefix("network."),
        index=counter,
        scheme=scheme,
        effect=effect,
        host=host,
        except_hosts=excepts,
        ports=ports,
        methods=methods,
        paths=paths,
        credential=credential,
        when=when,
        budget=raw.budget,
        key_path=path,
        deny_paths=tuple(deny_glob(g) for g in paths) if paths is not None and effect is Effect.DENY else None,
        passthrough=isinstance(raw, HttpRule) and raw.tls == "passthrough",
        query=query,
    )


def _ports(raw: list[int] | None, scheme: str, effect: Effect) -> frozenset[int] | None:
    """An allow rule without `ports` opens only its scheme's default port (443 / 80): opening is
    explicit. A deny rule without `ports` closes EVERY port: otherwise `deny host X` would still let
    an allow rule on X:8443 through, and a deny must never be narrower than it reads."""
    if raw:
        return frozenset(raw)
    if effect is Effect.DENY:
        return None
    return frozenset(DEFAULT_PORTS.get(scheme, ()))


def _host(raw: str, path: str, allow_any: bool, problems: list[tuple[str, str]]) -> HostPattern | None:
    try:
        return parse_host_pattern(raw, allow_any=allow_any)
    except GlobError as exc:
        problems.append((path, str(exc)))
        return None


def _methods(raw: list[str], path: str, problems: list[tuple[str, str]]) -> Iterator[str]:
    for j, method in enumerate(raw):
        try:
            canonical = canon_method(method)
        except CanonError as exc:
            problems.append((f"{path}[{j}]", f"bad method: {exc}"))
            continue
        if canonical != method:
            problems.append((f"{path}[{j}]", f"methods are case-sensitive; write {canonical!r}"))
        yield canonical


def _paths(raw: list[str], path: str, problems: list[tuple[str, str]]) -> Iterator[PathGlob]:
    for j, glob in enumerate(raw):
        try:
            yield parse_path_glob(glob)
        except GlobError as exc:
            problems.append((f"{path}[{j}]", str(exc)))


def _conditions(raw: Conditions, path: str, problems: list[tuple[str, str]]) -> CompiledConditions:
    labels = tuple(
        (key, frozenset([value] if isinstance(value, str) else value))
        for key, value in sorted((raw.labels or {}).items())
    )
    within, after = raw.within_seconds, raw.after_seconds
    if within is not None and after is not None and after >= within:
        problems.append((path, "after_seconds must be smaller than within_seconds (never true otherwise)"))

    def hosts(key: str, values: list[str] | None) -> tuple[HostPattern, ...] | None:
        if values is None:
            return None
        return tuple(p for j, h in enumerate(values) if (p := _host(h, f"{path}.{key}[{j}]", True, problems)))

    return CompiledConditions(
        labels=labels,
        sandbox_ids=frozenset(raw.sandbox) if raw.sandbox is not None else None,
        within_seconds=raw.within_seconds,
        after_seconds=raw.after_seconds,
        after_request_to=hosts("after_request_to", raw.after_request_to),
        unless_request_to=hosts("unless_request_to", raw.unless_request_to),
    )


def _compile_dns(model: Policy, policy: CompiledPolicy, problems: list[tuple[str, str]]) -> DnsSettings:
    dns = model.network.dns
    allow = []
    for i, name in enumerate(dns.allow):
        pattern = _host(name, f"network.dns.allow[{i}]", False, problems)
        if pattern is None:
            continue
        allow.append(pattern)
        policy._dns_index.add(
            CompiledRule(
                id=f"dns.allow[{i}]", index=-len(dns.allow) + i, scheme="dns", effect=Effect.ALLOW,
                host=pattern, except_hosts=(), ports=frozenset(), methods=None, paths=None,
                credential=None, when=None, budget=None, key_path=f"network.dns.allow[{i}]",
            )
        )
    qtypes = set()
    for i, qtype in enumerate(dns.query_types):
        if not qtype.isalnum() or qtype.upper() != qtype:
            problems.append((f"network.dns.query_types[{i}]", "query types are upper-case names, e.g. AAAA"))
        qtypes.add(qtype)
    budget = dns.budget
    return DnsSettings(
        allow=tuple(allow),
        deny_rcode=dns.deny_rcode,
        query_types=frozenset(qtypes),
        max_queries=budget.queries if budget else None,
        max_name_bytes=budget.name_bytes if budget else None,
        rate_per_second=budget.per_second if budget else None,
        deny_answer=dns.deny_answer,
    )


def _credential_problems(policy: CompiledPolicy) -> Iterator[tuple[str, str]]:
    """Two rules binding different credentials to requests both could match is ambiguous: refuse it."""
    bound = [r for r in policy.rules if r.credential is not None]
    for i, a in enumerate(bound):
        for b in bound[i + 1 :]:
            assert a.ports is not None and b.ports is not None  # allow rules always have ports
            if a.credential == b.credential or a.host != b.host or not (a.ports & b.ports):
                continue
            if a.methods is not None and b.methods is not None and not (a.methods & b.methods):
                continue
            if _paths_disjoint(a, b):
                continue
            yield (
                f"{b.key_path}.credential",
                f"credential {b.credential!r} overlaps rule {a.id!r} (credential {a.credential!r}) "
                f"on {a.host}: a request could match both; make methods or paths disjoint",
            )


def _paths_disjoint(a: CompiledRule, b: CompiledRule) -> bool:
    """Conservative: only two sets of exact paths are provably disjoint."""
    if a.paths is None or b.paths is None or any(g.exact is None for g in (*a.paths, *b.paths)):
        return False
    return not ({g.exact for g in a.paths} & {g.exact for g in b.paths})
