"""The pure decision engine: `decide(policy, facts, state, now) -> Decision`.

No I/O and no clock: the caller passes `now`, so the gateway, the DNS resolver and `audit replay` get the
same answer for the same inputs. Order of checks (first failure wins):

1. metadata host names, then every address the caller would dial (or the IP literal host) through
   `addr.check_address` — metadata is never allowed, other non-global classes only via `allow_private`;
2. the sandbox's `outbound_bytes_max` (already spent is spent, whatever the rules say);
3. deny rules (file order) whose host, port, method, `when` and path all match -- a deny rule's path
   matches if ANY plausible server reading of the path does (policy.readings), and a path that has a
   reading no model covers is refused as `path_ambiguous` wherever a path deny rule applies;
4. allow rules for the host in file order: the first that fully matches allows. When none does, the
   reason is the deepest check some candidate got to (host < scheme < port < method < path <
   condition < budget), which tells the agent precisely what to change. For a CONNECT, that first rule
   also sets the tunnel's mode: intercepted, raw TCP (`tcp` rules only) or `tls: passthrough`;
5. only when the allow rules refused the request for *where* it goes and the policy requires approval
   for `network_expansion`: a live operator approval of this sandbox that covers it allows it
   (`approval_granted`, intercepted, no credential); otherwise the deny is `approval_required`
   (approvals/overlay.py states which requests an approval may cover) -- except for a package install
   under `package_install: deny`, refused `package_install_denied` (no operator could let it through);
6. an HTTP request the network allows (steps 4-5) that the caller recognised as a package install or a
   publish (`facts.op_class`, policy/opclass.py) is then gated by its class: `package_install: deny` ->
   `package_install_denied`; `package_install: approval`, or `publish` in `require_approval_for` -> a live
   approval of that kind for this sandbox that covers it (`approval_granted`, the rule's credential kept),
   else `approval_required` with `approval_kind` set. A class never allows what the rules refuse.
"""

from __future__ import annotations

from dataclasses import replace

from egressgate.approvals.overlay import NETWORK_EXPANSION, approvable, class_covering, covering
from egressgate.policy.addr import METADATA_HOSTNAMES, AddrClass, check_address
from egressgate.policy.canon import parse_ip_literal
from egressgate.policy.compile import CompiledConditions, CompiledPolicy, CompiledRule
from egressgate.policy.facts import Decision, Facts, Operation, RuleUsage, SandboxState
from egressgate.policy.messages import deny_message
from egressgate.policy.opclass import PACKAGE_INSTALL, PUBLISH
from egressgate.policy.readings import AmbiguousPath, server_readings
from egressgate.policy.reasons import Effect, Reason

CONNECT_SCHEMES = ("https", "http", "tcp")

# Depth of the check where a candidate rule failed; higher is more specific.
_STAGES = (
    Reason.HOST_NOT_ALLOWED,
    Reason.SCHEME_NOT_ALLOWED,
    Reason.PORT_NOT_ALLOWED,
    Reason.METHOD_NOT_ALLOWED,
    Reason.PATH_NOT_ALLOWED,
    Reason.CONDITION_FAILED,
    Reason.BUDGET_EXCEEDED,
)
_DEPTH: dict[Reason | str, float] = {reason: i for i, reason in enumerate(_STAGES)}
# A rule that matched all but TRACE on a credential: reported as method_not_allowed, ranked after paths.
_TRACE_ON_CREDENTIAL = "trace_on_credential"
_DEPTH[_TRACE_ON_CREDENTIAL] = _DEPTH[Reason.PATH_NOT_ALLOWED] + 0.5
# A rule that matched the path but not its `query:` (querymatch.py): reported as path_not_allowed (the
# request target is not allowed), detail "query", ranked after a plain path mismatch.
_QUERY_MISMATCH = "query_mismatch"
_DEPTH[_QUERY_MISMATCH] = _DEPTH[Reason.PATH_NOT_ALLOWED] + 0.25
_NO_USAGE = RuleUsage()


def decide(policy: CompiledPolicy, facts: Facts, state: SandboxState, now: float) -> Decision:
    if facts.operation is Operation.DNS_QUERY:
        return _decide_dns(policy, facts, state)

    denied = _address_denial(policy, facts)
    if denied is not None:
        return denied
    limit = policy.outbound_bytes_max
    if limit is not None and state.bytes_out >= limit:
        return _deny(policy, facts, Reason.BUDGET_EXCEEDED, None, detail="outbound_bytes_max")

    connect = facts.operation is Operation.CONNECT
    schemes = CONNECT_SCHEMES if connect else (facts.scheme or "",)
    if not connect and facts.scheme not in ("https", "http", "tcp"):
        return _deny(policy, facts, Reason.SCHEME_NOT_ALLOWED, None)

    readings: list[frozenset[str] | AmbiguousPath] = []  # computed at most once, only if a path deny rule asks
    for scheme in schemes:
        for rule in policy.candidates(scheme, Effect.DENY, facts.host):
            verdict = _deny_rule_verdict(rule, facts, state, now, connect, readings)
            if verdict is not None:
                return _deny(policy, facts, verdict[0], rule, detail=verdict[1])

    best: tuple[Reason | str, CompiledRule | None] = (Reason.HOST_NOT_ALLOWED, None)
    intercept = False
    allowed: CompiledRule | None = None
    for scheme in schemes:
        for rule in policy.candidates(scheme, Effect.ALLOW, facts.host):
            failure = _allow_rule_failure(rule, facts, state, now, connect)
            if failure is None:
                if not connect:
                    allow = _allow(rule, intercept=True)
                    return allow if facts.op_class is None else _gate(policy, facts, state, now, allow, rule)
                allowed = allowed or rule
                intercept = intercept or rule.scheme != "tcp"
            elif _DEPTH[failure] > _DEPTH[best[0]]:
                best = (failure, rule)
    detail = None
    if best[0] == _TRACE_ON_CREDENTIAL:
        best = (Reason.METHOD_NOT_ALLOWED, best[1])
    elif best[0] == _QUERY_MISMATCH:
        best, detail = (Reason.PATH_NOT_ALLOWED, best[1]), "query"
    if allowed is not None:
        # The first allowing rule sets the tunnel's mode (file order, https before http before tcp): a
        # passthrough rule first means no interception, whatever later rules would have matched.
        return _allow(allowed, intercept=intercept and not allowed.passthrough, passthrough=allowed.passthrough)

    if best[1] is None and not connect and _host_in_other_scheme(policy, facts):
        best = (Reason.SCHEME_NOT_ALLOWED, None)
    assert isinstance(best[0], Reason)
    if NETWORK_EXPANSION in policy.approval_kinds and approvable(facts, best[0]):
        grant = covering(state.approvals, facts, state.sandbox_id, now)
        if grant is not None:
            allow = Decision(effect=Effect.ALLOW, reason=Reason.APPROVAL_GRANTED, approval_id=grant.id)
            return allow if facts.op_class is None else _gate(policy, facts, state, now, allow, None)
        if facts.op_class == PACKAGE_INSTALL and policy.package_install == "deny":
            return _deny(policy, facts, Reason.PACKAGE_INSTALL_DENIED, None, detail=facts.op_protocol)
        return _deny(policy, facts, Reason.APPROVAL_REQUIRED, best[1], detail=str(best[0]))
    return _deny(policy, facts, best[0], best[1], detail=detail)


def _gate(policy: CompiledPolicy, facts: Facts, state: SandboxState, now: float, allow: Decision,
          rule: CompiledRule | None) -> Decision:
    """Step 6: an allowed request of an operation class, under the policy's control of that class."""
    kind = facts.op_class
    if kind == PACKAGE_INSTALL:
        mode = policy.package_install
        if mode == "allow":
            return allow
        if mode == "deny":
            return _deny(policy, facts, Reason.PACKAGE_INSTALL_DENIED, rule, detail=facts.op_protocol)
    elif kind != PUBLISH or PUBLISH not in policy.approval_kinds:
        return allow
    grant = class_covering(state.approvals, facts, kind, state.sandbox_id, now)
    if grant is not None:
        return replace(allow, reason=Reason.APPROVAL_GRANTED, approval_id=grant.id, approval_kind=kind)
    return replace(_deny(policy, facts, Reason.APPROVAL_REQUIRED, rule, detail=kind), approval_kind=kind)


def _allow(rule: CompiledRule, *, intercept: bool, passthrough: bool = False) -> Decision:
    return Decision(
        effect=Effect.ALLOW,
        reason=Reason.RULE_MATCHED,
        rule_id=rule.id,
        capability=rule.credential,
        intercept=intercept,
        passthrough=passthrough,
    )


def _deny(
    policy: CompiledPolicy,
    facts: Facts,
    reason: Reason,
    rule: CompiledRule | None,
    detail: str | None = None,
) -> Decision:
    return Decision(
        effect=Effect.DENY,
        reason=reason,
        rule_id=rule.id if rule is not None else None,
        detail=detail,
        message=deny_message(policy, facts, reason, rule, detail),
    )


def _address_denial(policy: CompiledPolicy, facts: Facts) -> Decision | None:
    if facts.host in METADATA_HOSTNAMES:
        return _deny(policy, facts, Reason.METADATA_ENDPOINT, None, detail="metadata_hostname")
    literal = parse_ip_literal(facts.host)
    addresses = (literal, *facts.addresses) if literal is not None else facts.addresses
    for address in addresses:
        verdict = check_address(address, policy.allow_private)
        if verdict is None:
            continue
        if verdict.addr_class is AddrClass.METADATA:
            return _deny(policy, facts, Reason.METADATA_ENDPOINT, None, detail=str(verdict.addr_class))
        return _deny(policy, facts, Reason.ADDRESS_FORBIDDEN, None, detail=str(verdict.addr_class))
    return None


def _port_ok(rule: CompiledRule, facts: Facts) -> bool:
    return facts.port is None or rule.ports is None or facts.port in rule.ports


def _deny_rule_verdict(
    rule: CompiledRule,
    facts: Facts,
    state: SandboxState,
    now: float,
    connect: bool,
    readings: list[frozenset[str] | AmbiguousPath],
) -> tuple[Reason, str | None] | None:
    """(reason, detail) when `rule` refuses the request, None when it does not apply.

    A deny rule's paths fail closed: they match the canonical path (wildcards crossing `%2F`) or ANY
    server reading of it (policy.readings); a path with a reading that cannot be modelled is refused
    (`path_ambiguous`) by every path deny rule that would otherwise apply to the request."""
    if not _port_ok(rule, facts):
        return None
    if connect and (rule.methods is not None or rule.paths is not None or rule.query is not None):
        return None  # decided per request inside the (intercepted) tunnel
    if rule.methods is not None and facts.method not in rule.methods:
        return None
    if rule.when is not None and not _conditions_hold(rule.when, state, now):
        return None
    if rule.query is not None and not rule.query.denies(facts.query):
        return None  # an ambiguous query is denied (querymatch.py), like an ambiguous path
    globs = rule.deny_paths
    if globs is None:
        return Reason.DENIED_BY_RULE, None
    path = facts.path
    if path is None:
        return None
    if not readings:
        try:
            readings.append(server_readings(path))
        except AmbiguousPath as exc:
            readings.append(exc)
    found = readings[0]
    if isinstance(found, AmbiguousPath):
        if any(g.canonical.matches(path) for g in globs):
            return Reason.DENIED_BY_RULE, None
        return Reason.PATH_AMBIGUOUS, found.code
    if any(g.reading.matches(r) for g in globs for r in found):
        return Reason.DENIED_BY_RULE, None
    # A path that is its only reading (plain: no escapes, no upper case...) is fully checked above.
    if len(found) > 1 and any(g.canonical.matches(path) for g in globs):
        return Reason.DENIED_BY_RULE, None
    return None


def _allow_rule_failure(
    rule: CompiledRule, facts: Facts, state: SandboxState, now: float, connect: bool
) -> Reason | str | None:
    if not _port_ok(rule, facts):
        return Reason.PORT_NOT_ALLOWED
    if not connect:
        if rule.methods is not None and facts.method not in rule.methods:
            return Reason.METHOD_NOT_ALLOWED
        if not rule.path_allows(facts.path):
            return Reason.PATH_NOT_ALLOWED
        if rule.query is not None and not rule.query.allows(facts.query):
            return _QUERY_MISMATCH
        if rule.credential is not None and facts.method == "TRACE":
            return _TRACE_ON_CREDENTIAL  # TRACE echoes the request, injected credential included
    if rule.when is not None and not _conditions_hold(rule.when, state, now):
        return Reason.CONDITION_FAILED
    # an intercepted tunnel's requests are each checked; a relayed tunnel (tcp, passthrough) is its one request
    relayed = rule.scheme == "tcp" or rule.passthrough
    if (not connect or relayed) and rule.budget is not None and _over_budget(rule, facts, state):
        return Reason.BUDGET_EXCEEDED
    return None


def _conditions_hold(cond: CompiledConditions, state: SandboxState, now: float) -> bool:
    for key, values in cond.labels:
        if state.labels.get(key) not in values:
            return False
    if cond.sandbox_ids is not None and state.sandbox_id not in cond.sandbox_ids:
        return False
    elapsed = now - state.admitted_at
    if cond.within_seconds is not None and elapsed >= cond.within_seconds:
        return False
    if cond.after_seconds is not None and elapsed < cond.after_seconds:
        return False
    if cond.after_request_to is not None and not _seen_any(cond.after_request_to, state):
        return False
    return not (cond.unless_request_to is not None and _seen_any(cond.unless_request_to, state))


def _seen_any(patterns, state: SandboxState) -> bool:
    return any(p.matches(host) for p in patterns for host in state.seen_hosts)


def _over_budget(rule: CompiledRule, facts: Facts, state: SandboxState) -> bool:
    budget = rule.budget
    assert budget is not None
    usage = state.rule_usage.get(rule.id) or _NO_USAGE
    if budget.requests is not None and usage.requests >= budget.requests:
        return True
    if budget.bytes is None:
        return False
    return usage.bytes >= budget.bytes or usage.bytes + facts.request_bytes > budget.bytes


def _host_in_other_scheme(policy: CompiledPolicy, facts: Facts) -> bool:
    return any(
        policy.candidates(scheme, Effect.ALLOW, facts.host)
        for scheme in CONNECT_SCHEMES
        if scheme != facts.scheme
    )


def _decide_dns(policy: CompiledPolicy, facts: Facts, state: SandboxState) -> Decision:
    dns = policy.dns
    if facts.host in METADATA_HOSTNAMES:
        return _deny(policy, facts, Reason.METADATA_ENDPOINT, None, detail="metadata_hostname")
    if facts.qtype not in dns.query_types:
        return _deny(policy, facts, Reason.QTYPE_NOT_ALLOWED, None, detail=facts.qtype)
    if dns.max_queries is not None and state.dns_queries >= dns.max_queries:
        return _deny(policy, facts, Reason.BUDGET_EXCEEDED, None, detail="dns.budget.queries")
    if dns.max_name_bytes is not None and state.dns_name_bytes + len(facts.host) > dns.max_name_bytes:
        return _deny(policy, facts, Reason.BUDGET_EXCEEDED, None, detail="dns.budget.name_bytes")
    rule = policy.dns_name_allowed(facts.host)
    if rule is None:
        return _deny(policy, facts, Reason.HOST_NOT_ALLOWED, None)
    return Decision(effect=Effect.ALLOW, reason=Reason.RULE_MATCHED, rule_id=rule.id)
