"""The sandbox's past for `audit replay`: the recorded `SandboxState` of a decision, or the state
reconstructed from the log itself when a record carries none (docs/audit.md, "Replay")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from egressgate.approvals.grant import Grant
from egressgate.audit.record import K_DNS_NAME, K_HOST, K_LABELS, K_OPERATION, K_SCHEME
from egressgate.policy.facts import RuleUsage, SandboxState
from egressgate.policy.globs import GlobError, HostPattern, parse_host_pattern


@dataclass(slots=True)
class History:
    """The sandbox's past as seen in the log, for records that carry no recorded state."""

    admitted_at: float | None = None
    bytes_out: int = 0
    bytes_in: int = 0
    dns_queries: int = 0
    dns_name_bytes: int = 0
    seen_hosts: set[str] = field(default_factory=set)
    usage: dict[str, list[int]] = field(default_factory=dict)


def as_int(v: Any, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def state_from(
    attrs: dict[str, Any], sandbox_id: str, hist: History, time_s: float,
    scope_hint: Sequence[HostPattern] | None = None,
) -> tuple[SandboxState, bool]:
    """(state, exact). Exact when the gateway recorded the state it decided on. `scope_hint`: the recording
    policy's history patterns when the caller knows them (the replayed policy has the record's policy
    hash), for a record written before records stated their `seen_scope`."""
    labels = attrs.get(K_LABELS) if isinstance(attrs.get(K_LABELS), dict) else {}
    labels = {str(k): str(v) for k, v in labels.items()}
    if "egressgate.state.admitted_at" in attrs:
        usage_raw = attrs.get("egressgate.state.rule_usage")
        usage = {
            str(rule): RuleUsage(as_int(u.get("requests")), as_int(u.get("bytes")))
            for rule, u in (usage_raw.items() if isinstance(usage_raw, dict) else ())
            if isinstance(u, dict)
        }
        # A record may carry only the fields its decision reads (DNS records: admitted_at and the DNS
        # counters); the fields it leaves out come from the log's history, as without recorded state.
        # Gateway records carry only the history hosts and rule usage the *recording* policy could read
        # (CompiledPolicy.relevant_state); a replayed policy may ask about others, so the recorded values
        # are merged over what the log's history says (seen_hosts_from: only for hosts the record does not
        # answer for).
        history_usage = {r: RuleUsage(u[0], u[1]) for r, u in hist.usage.items()}
        return SandboxState(
            sandbox_id=sandbox_id,
            admitted_at=float(attrs["egressgate.state.admitted_at"]),
            labels=labels,
            bytes_out=as_int(attrs.get("egressgate.state.bytes_out"), hist.bytes_out),
            bytes_in=as_int(attrs.get("egressgate.state.bytes_in"), hist.bytes_in),
            dns_queries=as_int(attrs.get("egressgate.state.dns_queries"), hist.dns_queries),
            dns_name_bytes=as_int(attrs.get("egressgate.state.dns_name_bytes"), hist.dns_name_bytes),
            seen_hosts=seen_hosts_from(attrs, hist, scope_hint),
            rule_usage={**history_usage, **usage} if isinstance(usage_raw, dict) else history_usage,
            approvals=grants_from(attrs.get("egressgate.state.approvals")),
        ), True
    return SandboxState(
        sandbox_id=sandbox_id,
        admitted_at=hist.admitted_at if hist.admitted_at is not None else time_s,
        labels=labels,
        bytes_out=hist.bytes_out,
        bytes_in=hist.bytes_in,
        dns_queries=hist.dns_queries,
        dns_name_bytes=hist.dns_name_bytes,
        seen_hosts=frozenset(hist.seen_hosts),
        rule_usage={r: RuleUsage(u[0], u[1]) for r, u in hist.usage.items()},
    ), False


def seen_hosts_from(attrs: dict[str, Any], hist: History, scope_hint: Sequence[HostPattern] | None) -> frozenset[str]:
    """The hosts the sandbox had contacted, as the recorded decision saw them.

    The record's `seen_hosts` is the exact answer for every host its `seen_scope` patterns match (the
    recording policy's `when` patterns): a host the log's history has there but the record does not was
    added after the decision's snapshot (a concurrent request whose record was written first), so the
    decision did not see it and neither does the replay. Hosts outside the scope (a replayed policy asking
    about others) come from the log's history. A record without `seen_scope` (written before it was
    recorded) uses `scope_hint` when the caller knows the recording policy; else the recorded hosts are
    merged with the whole history, as before (approximate for hosts seen concurrently)."""
    seen = attrs.get("egressgate.state.seen_hosts")
    if not isinstance(seen, list):
        return frozenset(hist.seen_hosts)
    recorded = frozenset(str(h) for h in seen)
    raw = attrs.get("egressgate.state.seen_scope")
    if isinstance(raw, list):  # a forged or corrupt scope (not all pattern strings) answers for nothing
        scope = _scope(tuple(raw)) if all(isinstance(p, str) for p in raw) else None
    else:
        scope = scope_hint
    if scope is None:
        return recorded.union(hist.seen_hosts)
    return recorded.union(h for h in hist.seen_hosts if not any(p.matches(h) for p in scope))


@lru_cache(maxsize=256)
def _scope(raw: tuple[str, ...]) -> tuple[HostPattern, ...] | None:
    """A recorded scope's patterns (parsed once per distinct scope: every record of a policy has the same);
    None (scope unknown: the whole history is merged) when any is malformed."""
    try:
        return tuple(parse_host_pattern(p, allow_any=True) for p in raw)
    except GlobError:
        return None


def grants_from(raw: Any) -> tuple[Grant, ...]:
    """The operator approvals the gateway decided with (`egressgate.state.approvals`); a malformed entry
    grants nothing in the replay either."""
    out = []
    for item in raw if isinstance(raw, list) else ():
        try:
            out.append(Grant.from_json(item) if isinstance(item, dict) else None)
        except ValueError:
            continue
    return tuple(g for g in out if g is not None)


def update_history(hist: History, attrs: dict[str, Any], time_s: float) -> None:
    op = attrs.get(K_OPERATION)
    if hist.admitted_at is None:
        hist.admitted_at = time_s  # first sight; an admission record (below) is exact
    if op == "admission":
        hist.admitted_at = time_s
    elif op == "outcome":
        hist.bytes_out += as_int(attrs.get("egressgate.bytes.out"))
        hist.bytes_in += as_int(attrs.get("egressgate.bytes.in"))
    elif op == "dns_query":
        hist.dns_queries += 1
        hist.dns_name_bytes += len(str(attrs.get(K_DNS_NAME) or attrs.get(K_HOST) or "").encode())
    elif attrs.get("egressgate.decision") == "allow" and (
            op == "http_request" or (op == "connect" and relayed(attrs))):
        host = attrs.get(K_HOST)
        if isinstance(host, str):
            hist.seen_hosts.add(host)
        rule = attrs.get("egressgate.rule")
        if isinstance(rule, str):
            u = hist.usage.setdefault(rule, [0, 0])
            u[0] += 1
            u[1] += as_int(attrs.get("egressgate.facts.request_bytes"))


def relayed(attrs: dict[str, Any]) -> bool:
    """A connect record of a tunnel the gateway relays unread (a tcp rule, `tls: passthrough`): that tunnel
    is the request and entered the sandbox's history (gateway/shared/history.py); an intercepted tunnel's
    requests have their own records."""
    return (attrs.get("egressgate.intercept") is False or attrs.get(K_SCHEME) == "tcp"
            or attrs.get("egressgate.tls") == "passthrough")


