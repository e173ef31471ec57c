"""The compiled policy: the immutable, indexed form the decision engine reads.

Per request the engine must not scan rules: each (scheme, effect) has an exact-host dict and a
wildcard-suffix dict, and a lookup walks only the labels of the requested host. What the engine may read
of a sandbox's state is stated here too (`CompiledPolicy.relevant_state`). Building one from a validated
model, with every problem that is not a schema error, is policy/compiler.py's job.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from egressgate.policy import querymatch
from egressgate.policy.canon import parse_ip_literal
from egressgate.policy.facts import RuleUsage, SandboxState
from egressgate.policy.globs import DenyGlob, HostPattern, PathGlob
from egressgate.policy.mcp_compile import EMPTY_MCP, CompiledMcp
from egressgate.policy.model import Budget, Policy
from egressgate.policy.reasons import Effect

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

    def add_rule(self, rule: CompiledRule) -> None:
        """Index one compiled rule (policy/compiler.py adds them in file order: earlier rules win): its
        (scheme, effect) lookup, and for an allow rule the names it makes resolvable."""
        self.rules.append(rule)
        self.index[(rule.scheme, rule.effect)].add(rule)
        if rule.effect is Effect.ALLOW:
            self._dns_index.add(rule)

    def add_dns_name(self, entry: CompiledRule) -> None:
        """A `network.dns.allow` entry: resolvable, but never a rule that allows a request."""
        self._dns_index.add(entry)

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
