"""One DNS query in, one answer (or nothing) out: identity, policy, budgets, upstream, filter, audit.

Transport-independent (server.py owns sockets). Order of work for a query, and why:
1. strict parse (wire.py) - garbage is dropped or FORMERR/NOTIMP'd before anything is looked up;
2. who is asking (the state store maps source address -> sandbox) and which policy applies;
3. name shape and canonicalization - one canonical name is used to decide, to ask upstream, to cache and
   to audit;
4. rate (in process), then the atomic budget count in the state store, then `decide()` (pure: name
   allowlist, query type, count/name-byte budgets, on the counts before this query) - a denied name is never
   sent upstream;
5. cache or upstream, then the answer filter (filter.py) with the sandbox's `allow_private`;
6. the audit record, awaited before the answer leaves: if it cannot be written the client gets SERVFAIL.

Rcodes: a name the policy does not allow gets the gateway's address (`dns.deny_answer: gateway`, the default,
when the gateway runs a transparent listener: gateway_answer.py) or the policy's `dns.deny_rcode` (NXDOMAIN by
default; REFUSED configurable); a disallowed query type, an exhausted budget or rate, a non-IN class and
unknown clients get REFUSED (config `deny_rcode` for unknown clients); an allowed answer that the filter
emptied gets the policy's deny rcode; every dependency failure (state, policy, audit, upstream) gets SERVFAIL.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from dnslib import DNSLabel

from egressgate.audit.event import AuditUnavailable
from egressgate.audit.sink import AuditSink
from egressgate.dns import gateway_answer
from egressgate.dns.answer import pack_answer
from egressgate.dns.cache import AnswerCache, CacheEntry
from egressgate.dns.config import DnsConfig
from egressgate.dns.decisions import DnsDecisions
from egressgate.dns.events import QueryContext, describe, dns_event, qtype_name, requested_name
from egressgate.dns.filter import filter_answer
from egressgate.dns.limits import RateLimiter
from egressgate.dns.metrics import DnsMetrics
from egressgate.dns.upstream import Upstream, UpstreamFailed
from egressgate.dns.wire import (
    CLASS_IN,
    FORMERR,
    NOERROR,
    NOTIMP,
    RCODE_BY_NAME,
    REFUSED,
    SERVFAIL,
    Drop,
    Malformed,
    bare_response,
    opt_record,
    parse_query,
    udp_limit,
)
from egressgate.policy.canon import CanonError, canon_host
from egressgate.policy.compile import CompiledPolicy
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Effect, Reason
from egressgate.state.base import StateStore, StateUnavailable

PolicyLookup = Callable[[str], CompiledPolicy | None]
# Never forwarded whatever a policy says: zone transfers, meta types, transaction signatures.
NEVER_TYPES = frozenset({41, 249, 250, 251, 252, 253, 254})
# Denials of the name itself: with `network.dns.deny_answer: gateway` the name points at the gateway, whose
# transparent listener then answers the request with the deny body (gateway_answer.py)
GATEWAY_ANSWERED = frozenset({Reason.HOST_NOT_ALLOWED, Reason.METADATA_ENDPOINT})


class Resolver:
    def __init__(
        self,
        policies: PolicyLookup,
        state: StateStore,
        audit: AuditSink,
        config: DnsConfig,
        metrics: DnsMetrics | None = None,
    ) -> None:
        self.policies = policies
        self.state = state
        self.audit = audit
        self.config = config.validate()
        self.metrics = metrics or DnsMetrics()
        self.upstream = Upstream(
            config.resolved_upstreams(), config.upstream_timeout, config.upstream_edns_size, self.metrics
        )
        self.cache = AnswerCache(config.cache_size, config.cache_min_ttl, config.cache_max_ttl, config.negative_ttl)
        self.rate = RateLimiter()
        self.decisions = DnsDecisions()
        # Request ids: a random per-process prefix and a counter (unique, and cheaper than 12 random bytes).
        self._rid_prefix = secrets.token_hex(8)
        self._rid = itertools.count()
        self._inflight: dict[tuple[str, int], asyncio.Future[CacheEntry]] = {}
        self._unknown: OrderedDict[str, list[int]] = OrderedDict()  # budgets of unregistered sources

    # --- entry point ---------------------------------------------------------------------------------

    async def handle(self, packet: bytes, client: str, udp: bool) -> bytes | None:
        """The answer for one query packet from `client` (IP text), or None to send nothing."""
        try:
            query = parse_query(packet, self.config.max_query_size)
        except Drop as drop:
            setattr(self.metrics, drop.metric, getattr(self.metrics, drop.metric) + 1)
            return None
        except Malformed as bad:
            if bad.rcode == NOTIMP:
                self.metrics.notimp += 1
            else:
                self.metrics.formerr += 1
            return bare_response(bad.header[0], bad.header[1], bad.rcode, bad.question)
        opt = opt_record(self.config.max_udp_response) if query.edns else b""
        if query.edns and query.edns_version != 0:
            self.metrics.formerr += 1  # BADVERS (RFC 6891): extended rcode 1 with header rcode 0
            return bare_response(
                query.id,
                query.flags,
                NOERROR,
                query.question,
                opt_record(self.config.max_udp_response, ext_rcode=1),
            )
        ctx = QueryContext(query, client, "udp" if udp else "tcp", time.monotonic())
        try:
            answer = await self._resolve(ctx, opt)
        except Exception:
            self.metrics.internal_errors += 1
            self.metrics.servfail += 1
            answer = bare_response(query.id, query.flags, SERVFAIL, query.question, opt)
        if udp and len(answer) > udp_limit(query, self.config.max_udp_response):
            self.metrics.truncated += 1
            answer = bare_response(query.id, query.flags, NOERROR, query.question, opt, tc=True)
        return answer

    # --- decision ------------------------------------------------------------------------------------

    async def _resolve(self, ctx: QueryContext, opt: bytes) -> bytes:
        query = ctx.query
        self.metrics.queries += 1
        try:
            record = await self.state.by_address(ctx.client)
        except StateUnavailable:
            self.metrics.state_failures += 1
            return await self._refuse(ctx, opt, SERVFAIL, Reason.STATE_UNAVAILABLE)
        if record is not None and record.revoked:
            ctx.sandbox_id, ctx.host = record.id, requested_name(query)
            return await self._refuse(ctx, opt, RCODE_BY_NAME[self.config.deny_rcode], Reason.SANDBOX_REVOKED)
        if record is not None:
            ctx.sandbox_id, ctx.labels, ctx.admitted_at = record.id, dict(record.labels), record.admitted_at
            policy_name: str | None = record.policy_name
        elif self.config.unknown_client_policy is None:
            ctx.host = requested_name(query)  # the record names what an unknown client asked for
            return await self._refuse(ctx, opt, RCODE_BY_NAME[self.config.deny_rcode], Reason.IDENTITY_UNKNOWN)
        else:
            policy_name = self.config.unknown_client_policy
        policy = self.policies(policy_name)
        if policy is None:
            return await self._refuse(ctx, opt, SERVFAIL, Reason.POLICY_UNAVAILABLE, detail=policy_name)
        ctx.policy = policy

        if query.qclass != CLASS_IN:
            return await self._refuse(ctx, opt, REFUSED, Reason.PROTOCOL_NOT_ALLOWED, detail="class")
        if not query.labels:
            return await self._refuse(ctx, opt, REFUSED, Reason.HOST_NOT_ALLOWED, detail="root")
        if not query.name_ok:
            self.metrics.formerr += 1
            return await self._refuse(ctx, opt, FORMERR, Reason.INVALID_REQUEST, detail="name bytes")
        sent = query.name_text
        try:
            host = canon_host(sent)
        except CanonError as exc:
            self.metrics.formerr += 1
            return await self._refuse(ctx, opt, FORMERR, Reason.INVALID_REQUEST, detail=f"name: {exc.code}")
        if host != sent.lower():
            # The canonical form is not the name itself (an IP-literal spelling, an IDN mapping): answering it
            # would mean resolving something other than what was asked.
            self.metrics.formerr += 1
            return await self._refuse(ctx, opt, FORMERR, Reason.INVALID_REQUEST, detail="non-canonical name")
        ctx.host = host

        qtype = query.qtype
        now = time.time()
        key = ctx.sandbox_id or f"unknown:{ctx.client}"
        rate = policy.dns.rate_per_second
        if rate is not None and not self.rate.allow(key, rate, time.monotonic()):
            self.metrics.rate_limited += 1
            return await self._refuse(ctx, opt, REFUSED, Reason.BUDGET_EXCEEDED, detail="dns.budget.per_second")
        if qtype in NEVER_TYPES:
            self.metrics.denied += 1
            return await self._refuse(ctx, opt, REFUSED, Reason.QTYPE_NOT_ALLOWED, detail=qtype_name(qtype))
        # Count first, then decide on the counts as they stood before this query. One atomic store call
        # replaces a snapshot() + a count: decide() sees exactly the counts the store settled (concurrent
        # queries cannot both pass on the same snapshot), and the DNS decision reads no other state.
        totals = await self._count(ctx)
        if totals is None:
            return await self._refuse(ctx, opt, SERVFAIL, Reason.STATE_UNAVAILABLE)
        ctx.dns_counts = (totals[0] - 1, totals[1] - len(host))
        ctx.admitted_at = ctx.admitted_at if ctx.admitted_at is not None else now
        decision = self.decisions.decide(policy, host, qtype_name(qtype), ctx, now)
        ctx.stage = "decide"
        if not decision.allowed:
            if decision.reason is Reason.BUDGET_EXCEEDED:
                self.metrics.budget_exceeded += 1
            else:
                self.metrics.denied += 1
            if decision.reason in GATEWAY_ANSWERED and policy.dns.deny_answer == "gateway":
                address = gateway_answer.answer_address(
                    self.config.gateway_answer, ctx.client, self.config.gateway_answer_networks
                )
                if address is not None:
                    return await self._to_gateway(ctx, opt, decision, address)
            rcode = (
                REFUSED
                if decision.reason in (Reason.QTYPE_NOT_ALLOWED, Reason.BUDGET_EXCEEDED)
                else RCODE_BY_NAME[policy.dns.deny_rcode]
            )
            return await self._refuse(ctx, opt, rcode, decision=decision)
        if not self.audit.healthy():
            # Do not let a query leave for upstream while its record could not be kept.
            ctx.stage = "resolver"
            self.metrics.audit_failures += 1
            return await self._refuse(ctx, opt, SERVFAIL, Reason.AUDIT_UNAVAILABLE)
        self.metrics.allowed += 1
        return await self._answer(ctx, opt, decision)

    async def _count(self, ctx: QueryContext) -> tuple[int, int] | None:
        """Count this query against the sandbox's DNS budget: one query plus the canonical name's bytes.

        Every audited query of a known sandbox is counted exactly once, allowed or not (denied probes spend
        budget too, which is conservative, and it is the rule `audit replay` uses to rebuild DNS counts from
        the log). Returns the new totals, or None when the state store failed."""
        if ctx.counted:
            return None
        ctx.counted = True
        name_bytes = len(ctx.host or "")
        if ctx.sandbox_id is not None:
            try:
                return await self.state.add_dns_query(ctx.sandbox_id, name_bytes)
            except (StateUnavailable, KeyError):  # KeyError: a store that lost the sandbox's record
                self.metrics.state_failures += 1
                return None
        counts = self._unknown.setdefault(ctx.client, [0, 0])
        self._unknown.move_to_end(ctx.client)
        if len(self._unknown) > self.config.unknown_client_table:
            self._unknown.popitem(last=False)
        counts[0] += 1
        counts[1] += name_bytes
        return counts[0], counts[1]

    # --- answers -------------------------------------------------------------------------------------

    async def _answer(self, ctx: QueryContext, opt: bytes, decision: Decision) -> bytes:
        query, policy, host = ctx.query, ctx.policy, ctx.host
        assert policy is not None and host is not None
        try:
            entry = await self._lookup(ctx, host, query.qtype)
        except UpstreamFailed as exc:
            self.metrics.servfail += 1
            return await self._refuse(ctx, opt, SERVFAIL, decision=decision, detail=exc.reason)
        filtered = entry.filtered.get(policy.allow_private)
        if filtered is None:
            filtered = filter_answer(
                DNSLabel(host),
                query.qtype,
                entry.answer.answers,
                entry.answer.authority,
                policy.allow_private,
            )
            entry.filtered[policy.allow_private] = filtered
        self.metrics.answers_stripped += filtered.stripped
        if filtered.emptied:
            self.metrics.emptied_answers += 1
            ctx.stage = "answer_filter"
            ctx.refused_addresses = filtered.refused
            return await self._refuse(
                ctx,
                opt,
                RCODE_BY_NAME[policy.dns.deny_rcode],
                Reason.ADDRESS_FORBIDDEN,
                detail="every address in the answer was removed",
            )
        rcode = entry.answer.rcode
        if not await self._audit(ctx, decision, rcode, describe(filtered)):
            return bare_response(query.id, query.flags, SERVFAIL, query.question, opt)
        return pack_answer(entry, filtered, query, (policy.allow_private, query.edns), self.config.max_udp_response)

    async def _lookup(self, ctx: QueryContext, host: str, qtype: int) -> CacheEntry:
        key = (host, qtype)
        entry = self.cache.get(key, time.monotonic())
        if entry is not None:
            self.metrics.cache_hits += 1
            ctx.cache = "hit"
            return entry
        pending = self._inflight.get(key)
        if pending is not None:  # single flight: identical concurrent queries share one upstream query
            self.metrics.cache_hits += 1
            ctx.cache = "coalesced"
            return await asyncio.shield(pending)
        self.metrics.cache_misses += 1
        ctx.cache = "miss"
        future: asyncio.Future[CacheEntry] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            answer = await self.upstream.resolve(tuple(host.encode("ascii").split(b".")), qtype)
            entry = self.cache.put(key, answer, time.monotonic())
            future.set_result(entry)
            return entry
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: there may be no other waiter
            raise
        finally:
            del self._inflight[key]

    # --- denials and audit ---------------------------------------------------------------------------

    async def _to_gateway(self, ctx: QueryContext, opt: bytes, decision: Decision, address: str) -> bytes:
        """A denied name answered with the gateway's address (gateway_answer.py): still a deny, audited as
        one (rcode NOERROR, the address it was pointed at, `egressgate.dns.answer` = gateway); nothing
        was asked upstream."""
        query = ctx.query
        ctx.answer_kind = "gateway"
        answers = [f"A {address}"] if query.qtype == gateway_answer.QTYPE_A else []
        if not await self._audit(ctx, decision, NOERROR, answers):
            return bare_response(query.id, query.flags, SERVFAIL, query.question, opt)
        return gateway_answer.pack(query, opt, address)

    async def _refuse(
        self,
        ctx: QueryContext,
        opt: bytes,
        rcode: int,
        reason: Reason | None = None,
        *,
        decision: Decision | None = None,
        detail: str | None = None,
    ) -> bytes:
        if decision is None:
            decision = Decision(effect=Effect.DENY, reason=reason or Reason.INVALID_REQUEST, detail=detail)
        elif detail is not None:
            decision = Decision(
                effect=decision.effect,
                reason=decision.reason,
                rule_id=decision.rule_id,
                detail=detail,
                message=decision.message,
            )
        if rcode == SERVFAIL and decision.reason is not Reason.AUDIT_UNAVAILABLE:
            self.metrics.servfail += 1
        query = ctx.query
        if not ctx.counted and (ctx.sandbox_id is not None or ctx.policy is not None):
            await self._count(ctx)
        if not await self._audit(ctx, decision, rcode, []):
            rcode = SERVFAIL
        return bare_response(query.id, query.flags, rcode, query.question, opt)

    async def _audit(self, ctx: QueryContext, decision: Decision, rcode: int, answers: list[str]) -> bool:
        event = dns_event(ctx, decision, rcode, answers, f"{self._rid_prefix}{next(self._rid):010x}")
        try:
            await self.audit.write(event)
        except Exception as exc:  # AuditUnavailable, or a sink bug: either way the record is not durable
            self.metrics.audit_failures += 1
            if not isinstance(exc, AuditUnavailable):
                self.metrics.internal_errors += 1
            return False
        return True
