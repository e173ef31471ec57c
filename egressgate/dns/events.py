"""What the resolver knows about one query, and the audit event it becomes.

One place builds the DNS `AuditEvent`, so every outcome (answered, denied, filtered, failed) carries the same
attributes: sandbox, client address, the name as sent and canonical, type, decision, reason, rcode, answers,
and - when `decide()` ran - the state it was given (admitted_at and the DNS counters: all a DNS decision
reads), for `audit replay`; its facts are the record's own operation/name/scheme/qtype attributes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dnslib import QTYPE

from egressgate.audit.build import build
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.dns.filter import Filtered
from egressgate.dns.wire import RCODE_BY_NAME, Query
from egressgate.policy.canon import CanonError, canon_host
from egressgate.policy.compile import CompiledPolicy
from egressgate.policy.facts import Decision

RCODE_NAME = {v: k for k, v in RCODE_BY_NAME.items()}


_QTYPE_NAMES: dict[int, str] = {}


def qtype_name(qtype: int) -> str:
    """The type's name ("A", "HTTPS"), or "TYPE1234" when unassigned; memoised (several calls per query)."""
    name = _QTYPE_NAMES.get(qtype)
    if name is None:
        try:
            name = str(QTYPE[qtype])
        except Exception:
            name = f"TYPE{qtype}"
        if len(_QTYPE_NAMES) < 65536:
            _QTYPE_NAMES[qtype] = name
    return name


@dataclass(slots=True)
class QueryContext:
    """What we know about one query while it is decided (becomes the audit record)."""

    query: Query
    client: str
    transport: str
    started: float
    sandbox_id: str | None = None
    labels: dict[str, str] | None = None
    policy: CompiledPolicy | None = None
    host: str | None = None
    cache: str | None = None
    admitted_at: float | None = None
    # (queries, name bytes) the state store held before this query: the state decide() was given
    dns_counts: tuple[int, int] | None = None
    counted: bool = False
    # Which step produced the outcome: "resolver" (identity, shape, rate, never-forwarded types, dependency
    # failures), "decide" (the policy decision), "answer_filter" (an allowed answer emptied by the filter).
    # `audit replay` can re-decide only "decide" outcomes.
    stage: str = "resolver"
    # the answer filter emptied the answer: the addresses its address check removed (what replay re-checks)
    refused_addresses: tuple[str, ...] = ()
    answer_kind: str | None = None  # "gateway": a denied name pointed at the gateway (gateway_answer.py)


def requested_name(query: Query) -> str | None:
    """The canonical name a query asked for, for the record of a query refused before the name checks
    (unknown or revoked client); None when the name is not already canonical (the raw labels are always
    in `egressgate.target.as_sent`)."""
    if not query.labels or not query.name_ok:
        return None
    try:
        host = canon_host(query.name_text)
    except CanonError:
        return None
    return host if host == query.name_text.lower() else None


def describe(filtered: Filtered) -> list[str]:
    """Answers as the audit record lists them: "A 93.184.216.34", "CNAME edge.example.net."."""
    return [f"{qtype_name(rr.rtype)} {rr.rdata}" for rr in filtered.answers]


def dns_event(ctx: QueryContext, decision: Decision, rcode: int, answers: list[str], request_id: str) -> AuditEvent:
    query, policy = ctx.query, ctx.policy
    extra: dict[str, str | int | float | bool | list[str]] = {
        "egressgate.dns.rcode": RCODE_NAME.get(rcode, str(rcode)),
        "egressgate.dns.transport": ctx.transport,
        "egressgate.dns.stage": ctx.stage,
    }
    if ctx.cache:
        extra["egressgate.dns.cache"] = ctx.cache
    if ctx.refused_addresses:
        extra["egressgate.facts.addresses"] = list(ctx.refused_addresses)
    if ctx.answer_kind:
        extra["egressgate.dns.answer"] = ctx.answer_kind
    if ctx.dns_counts is not None:
        # The state decide() was given, as far as a DNS decision reads it (docs/audit.md, "Replay"). The facts
        # (operation, name, scheme, qtype) are the record's own attributes.
        extra["egressgate.state.admitted_at"] = float(ctx.admitted_at or 0.0)
        extra["egressgate.state.dns_queries"] = ctx.dns_counts[0]
        extra["egressgate.state.dns_name_bytes"] = ctx.dns_counts[1]
    return build(
        EventKind.DNS_QUERY,
        request_id=request_id,
        verdict=decision,
        detail_key="egressgate.decision.detail",  # the DNS records' name for it (docs/audit.md)
        sandbox_id=ctx.sandbox_id,
        sandbox_labels=ctx.labels,
        capability=None,
        policy_name=policy.name if policy else None,
        policy_hash=policy.hash if policy else None,
        target_as_sent=b".".join(query.labels).decode("ascii", "backslashreplace"),
        scheme="dns",
        host=ctx.host,
        qtype=qtype_name(query.qtype),
        answers=answers,
        client_address=ctx.client,
        duration_ms=(time.monotonic() - ctx.started) * 1000.0,
        message=decision.message or None,  # DNS records keep an allow's message too (docs/audit.md)
        extra=extra,
    )
