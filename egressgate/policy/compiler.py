"""Compile a validated policy model (policy/model.py) into the indexed CompiledPolicy (policy/compile.py).

Everything that can be wrong with a policy but is not a schema error (bad globs, non-canonical hosts,
duplicate rule ids, credential bindings that overlap or point at wildcards, budgets on deny rules,
impossible conditions, DNS query types) is collected here with the key path of the culprit, and the policy
is refused as a whole (PolicyError): a policy loads completely or not at all.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

from egressgate.policy import querymatch
from egressgate.policy.canon import CanonError, canon_method
from egressgate.policy.compile import SCHEMES, CompiledConditions, CompiledPolicy, CompiledRule, DnsSettings
from egressgate.policy.errors import PolicyError
from egressgate.policy.execution import approval_kinds
from egressgate.policy.filesystem import filesystem_problems
from egressgate.policy.globs import GlobError, HostPattern, PathGlob, deny_glob, parse_host_pattern, parse_path_glob
from egressgate.policy.mcp_compile import compile_mcp
from egressgate.policy.model import Conditions, HttpRule, Policy, TcpRule
from egressgate.policy.passthrough import passthrough_problems, tls_problems
from egressgate.policy.persistence import persistence_problems
from egressgate.policy.reasons import Effect

DEFAULT_PORTS = {"https": (443,), "http": (80,)}


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
                policy.add_rule(rule)

    policy.dns = _compile_dns(model, policy, problems)
    policy.history_patterns = tuple(
        p
        for r in policy.rules
        if r.when is not None
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
                problems.append(
                    (f"{path}.credential", f"unknown capability {credential!r} (define it in credentials.capabilities)")
                )
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
        policy.add_dns_name(
            CompiledRule(
                id=f"dns.allow[{i}]",
                index=-len(dns.allow) + i,
                scheme="dns",
                effect=Effect.ALLOW,
                host=pattern,
                except_hosts=(),
                ports=frozenset(),
                methods=None,
                paths=None,
                credential=None,
                when=None,
                budget=None,
                key_path=f"network.dns.allow[{i}]",
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
