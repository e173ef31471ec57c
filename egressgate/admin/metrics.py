"""`/metrics`: the gateway's counters in the Prometheus text format (prometheus-client).

Two sources, read two ways:

- **What happened to requests** (decisions by reason and rule, bytes, durations, DNS rcodes) is taken from
  the audit records, in ONE place: `install()` taps the audit sink's three write methods (audit/observe.py),
  and every event that reaches the sink is observed once by `AuditMetrics.observe`. The audit event is already the one
  description of a decision (audit/build.py), so metrics cannot disagree with the trail, and no request
  path carries its own metric increments. `observe` runs on the event loop for every record: it takes no
  lock and formats no string - plain integer additions on dicts keyed by tuples of values the event
  already holds. (prometheus-client's own Counter/Histogram take a threading lock per increment; they are
  not used on this path.)
- **Component state** (audit sink queues and failures, broker mints and cache hits, state-store errors,
  open connections, the active policy set) is read at scrape time by `GatewayCollector.collect`, from the
  plain integers the components already keep.

Label cardinality is bounded by construction: `operation` is an EventKind, `reason` a policy.reasons value
(anything else is "other"), `rule` a rule id of a policy set the gateway has loaded (anything else -
e.g. an id an overlay made up - is "other"), `rcode` a DNS rcode name. No label ever carries a host, a
path, a sandbox id or anything else a sandbox chooses.

Per process: each process has its own counters, and every sample says which (`worker`, docs/operations.md
"Metrics").
"""

from __future__ import annotations

import hashlib
import os
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.observe import observe_writes
from egressgate.policy.reasons import Reason

if TYPE_CHECKING:
    from egressgate.gateway.shared.context import PolicyHolder, Runtime

REASONS = frozenset(r.value for r in Reason)
RCODES = frozenset({"NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN", "NOTIMP", "REFUSED"})
RCODE_KEY = "egressgate.dns.rcode"
OTHER = "other"
# seconds; the same buckets for every histogram (a DNS answer from cache is ~0.1 ms, a long download minutes)
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
           300.0)


def policy_set_version(policies: dict[str, Any]) -> str:
    """The version hash of a policy set: SHA-256 over its sorted `name=hash` lines, so it changes when any
    policy's content changes and stays the same when nothing did (reformatting keeps each hash)."""
    text = "".join(f"{name}={policies[name].hash}\n" for name in sorted(policies))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class Histogram:
    """Bucket counts without a lock (single event loop); cumulated at scrape time."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        running = 0
        buckets = []
        for bound, n in zip((*map(repr, BUCKETS), "+Inf"), self.counts, strict=True):
            running += n
            buckets.append((bound, running))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.sum)


class AuditMetrics:
    """Counts derived from audit events (see the module docstring for why here and how cheap)."""

    def __init__(self, policies: PolicyHolder) -> None:
        self._holder = policies
        self._seen_set: object = None
        self._rules: frozenset[str] = frozenset()
        # (operation, decision, reason, rule) -> count, for every record except outcomes
        self.decisions: dict[tuple[str, str | None, str | None, str | None], int] = {}
        # (decision, reason, rule) -> count: outcome records (a budget cut, a refused websocket say deny)
        self.outcomes: dict[tuple[str | None, str | None, str | None], int] = {}
        self.bytes_out = 0
        self.bytes_in = 0
        self.flow_duration = Histogram()
        self.dns_duration = Histogram()
        self.dns_rcodes: dict[str, int] = {}

    def _rule(self, rule_id: str | None) -> str | None:
        if rule_id is None or rule_id in self._rules:
            return rule_id
        policies = self._holder.policies
        if policies is not self._seen_set:  # a reload swapped the set: learn its ids (old ones stay known)
            self._seen_set = policies
            self._rules = self._rules | rule_ids(policies)
            if rule_id in self._rules:
                return rule_id
        return OTHER

    def observe(self, event: AuditEvent) -> None:
        reason = event.reason
        if reason is not None and reason not in REASONS:
            reason = OTHER
        rule = self._rule(event.rule_id)
        kind = event.kind
        if kind is EventKind.OUTCOME:
            key = (event.decision, reason, rule)
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            if event.bytes_out:
                self.bytes_out += event.bytes_out
            if event.bytes_in:
                self.bytes_in += event.bytes_in
            if event.duration_ms is not None:
                self.flow_duration.observe(event.duration_ms / 1000.0)
            return
        dkey = (kind, event.decision, reason, rule)
        self.decisions[dkey] = self.decisions.get(dkey, 0) + 1
        if kind is EventKind.DNS_QUERY:
            rcode = event.extra.get(RCODE_KEY)
            if rcode is not None:
                if rcode not in RCODES:
                    rcode = OTHER
                self.dns_rcodes[rcode] = self.dns_rcodes.get(rcode, 0) + 1
            if event.duration_ms is not None:
                self.dns_duration.observe(event.duration_ms / 1000.0)


def rule_ids(policies: dict[str, Any]) -> frozenset[str]:
    """Every rule id of a policy set, DNS allow entries included (their ids are `dns.allow[i]`), and the
    MCP tool rules' ids (allowed tools' and deny entries', policy/mcp_compile.py): all come from loaded
    policies, so the label set stays bounded."""
    ids: set[str] = set()
    for policy in policies.values():
        ids.update(rule.id for rule in policy.rules)
        ids.update(f"dns.allow[{i}]" for i in range(len(policy.model.network.dns.allow)))
        mcp = getattr(policy, "mcp", None)
        for server in (mcp.servers.values() if mcp is not None else ()):
            ids.update(tool.rule_id for tool in server.allowed.values())
            ids.update(server.denied.values())
    return frozenset(ids)


def install(sink: Any, observe: Callable[[AuditEvent], None]) -> None:
    """Make `observe` see every event the sink accepts, once (audit/observe.py: a `write` once it returned
    durable, `write_after`/`enqueue_after` at once; installing again only swaps the observer, no double
    counting)."""
    observe_writes(sink, "metrics", observe)


def _counter(name: str, doc: str, value: int | float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: int | float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class GatewayCollector:
    """Builds every metric family at scrape time (prometheus-client custom collector)."""

    def __init__(self, rt: Runtime, audit: AuditMetrics) -> None:
        self.rt = rt
        self.audit = audit
        self._pid = os.getpid()
        self._process = ProcessCollector(registry=None)  # process_cpu_seconds_total, RSS, open fds (/proc)

    def collect(self) -> Iterator[Metric]:
        """Every family (and the process's CPU, memory and fds), each sample labelled `worker` (this
        process's state-store worker id, shortened): the `--workers` processes of one gateway answer on one
        shared admin address, and without the label their counters would interleave under one series (each
        scrape another process: false resets)."""
        worker = self.rt.state.worker_id[:12]
        for family in (*self._from_audit(), *self._components(), *self._process.collect()):
            family.samples = [s._replace(labels={**s.labels, "worker": worker}) for s in family.samples]
            yield family

    def _from_audit(self) -> Iterator[Metric]:
        am = self.audit
        decisions = CounterMetricFamily(
            "egressgate_decisions", "Audited decisions (every record except outcomes) by operation, decision, "
            "reason and rule id", labels=("operation", "decision", "reason", "rule"))
        for (kind, decision, reason, rule), n in sorted(am.decisions.items(), key=_sort_key):
            decisions.add_metric((str(kind), decision or "", reason or "", rule or ""), n)
        yield decisions
        outcomes = CounterMetricFamily(
            "egressgate_outcomes", "Outcome records of allowed flows by decision (deny: cut or refused while "
            "running), reason and rule id", labels=("decision", "reason", "rule"))
        for (decision, reason, rule), n in sorted(am.outcomes.items(), key=_sort_key):
            outcomes.add_metric((decision or "", reason or "", rule or ""), n)
        yield outcomes
        transferred = CounterMetricFamily("egressgate_bytes", "Bytes of finished flows as their outcome records "
                                          "count them (out: sandbox to upstream)", labels=("direction",))
        transferred.add_metric(("out",), am.bytes_out)
        transferred.add_metric(("in",), am.bytes_in)
        yield transferred
        yield am.flow_duration.family("egressgate_flow_duration_seconds",
                                      "Duration of allowed flows, decision to outcome record")
        yield am.dns_duration.family("egressgate_dns_query_duration_seconds",
                                     "Duration of DNS queries, arrival to answer decision")
        rcodes = CounterMetricFamily("egressgate_dns_answers", "DNS answers by rcode", labels=("rcode",))
        for rcode, n in sorted(am.dns_rcodes.items()):
            rcodes.add_metric((rcode,), n)
        yield rcodes

    def _components(self) -> Iterator[Metric]:
        rt = self.rt
        sink: Any = rt.audit
        yield _gauge("egressgate_audit_healthy", "1 while the audit sink accepts records, 0 while it denies",
                     1 if sink.healthy() else 0)
        queue = getattr(sink, "_queue", None)
        after = getattr(sink, "_after", ())
        pending = getattr(sink, "_pending", ())
        yield _gauge("egressgate_audit_queue_depth", "Records waiting for the audit writer",
                     (queue.qsize() if queue is not None else 0) + len(after))
        yield _gauge("egressgate_audit_retry_queue_depth", "Records of past events waiting for a retry after a "
                     "failed write (new requests are denied at audit.retry_queue_max)", len(pending))
        for attr, name, doc in (
            ("records_written", "egressgate_audit_records_written", "Audit lines written (checkpoints included)"),
            ("write_failures", "egressgate_audit_write_failures", "Audit batches that could not be made durable"),
            ("export_failures", "egressgate_audit_export_failures", "Audit batches the OTLP exporter did not take"),
            ("records_dropped", "egressgate_audit_records_dropped", "Records dropped (on_failure: allow-and-alert)"),
            ("records_lost", "egressgate_audit_records_lost", "Queued records not written before the sink stopped"),
        ):
            yield _counter(name, doc, getattr(sink, attr, 0))
        broker = rt.broker
        if broker is not None:
            yield _counter("egressgate_broker_mints", "Credentials minted or fetched by the broker", broker.mints)
            yield _counter("egressgate_broker_cache_hits", "Credential requests served from the broker's cache "
                           "or joined to a mint in flight", broker.hits)
            yield _counter("egressgate_broker_backend_calls", "Round trips to the secret backend",
                           getattr(broker.backend, "calls", 0))
        yield _counter("egressgate_state_errors", "State-store operations that failed (StateUnavailable)",
                       rt.state.errors)
        yield _gauge("egressgate_connections_open", "Client connections open on this process", len(rt.conns))
        yield _gauge("egressgate_sandboxes_connected", "Sandboxes with an open connection on this process",
                     len(rt.by_sandbox))
        policies = rt.policies.policies
        yield _gauge("egressgate_policies_loaded", "Policies in the active set", len(policies))
        # an info metric (`egressgate_policy_set_info{version=...} 1`): the version is a label to join and
        # compare replicas on, not a quantity; the _info suffix tells dashboards and recording rules so
        yield InfoMetricFamily("egressgate_policy_set", "The active policy set's version hash",
                               value={"version": policy_set_version(policies)})
        worker = GaugeMetricFamily("egressgate_worker_info", "The gateway process that answered this scrape (value 1)",
                                   labels=("worker_id", "pid"))
        worker.add_metric((rt.state.worker_id, str(self._pid)), 1)
        yield worker


def _sort_key(item: tuple[tuple, int]) -> tuple:
    return tuple("" if v is None else str(v) for v in item[0])


class GatewayMetrics:
    """The registry of one gateway process: the audit observer installed on its sink + the collector."""

    def __init__(self, rt: Runtime) -> None:
        self.audit = AuditMetrics(rt.policies)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(GatewayCollector(rt, self.audit))
        install(rt.audit, self.audit.observe)

    def render(self) -> bytes:
        return generate_latest(self.registry)
