"""CPU cost of one audit record: building it from an AuditEvent, then encoding + hash-chaining it.

Measures `record_from_event` and `ChainWriter.append` in a loop (process CPU time, best of 5 passes) for an
HTTP-request event and a DNS-query event shaped like the resolver's. No I/O: this is the per-record Python
cost the sink pays before its write. Run it against another source tree for before/after:

    .venv/bin/python loadtests/audit_record_bench.py [--n 20000]
    PYTHONPATH=DIR .venv/bin/python loadtests/audit_record_bench.py   # DIR: git archive <commit> egressgate ...
"""

from __future__ import annotations

import argparse
import time

from egressgate.audit.chain import ChainWriter
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.record import record_from_event


def http_event(i: int) -> AuditEvent:
    return AuditEvent(
        EventKind.HTTP_REQUEST, time.time_ns(), f"req-{i}", sandbox_id="sbx-bench", sandbox_labels={"team": "x"},
        decision="allow", reason="rule_matched", rule_id="openai", policy_name="invoice-analysis",
        policy_hash="sha256:" + "ab" * 32, target_as_sent="https://api.openai.com/v1/responses", scheme="https",
        host="api.openai.com", port=443, method="POST", path="/v1/responses", pinned_address="198.18.0.10",
        bytes_out=512, request_hash="sha256:" + "cd" * 32, body_hash="sha256:" + "ef" * 32,
    )


def dns_event(i: int) -> AuditEvent:
    """A denied query as dns/events.py builds it (the DNS counters recorded as egressgate.state.*)."""
    return AuditEvent(
        EventKind.DNS_QUERY, time.time_ns(), f"42db032e66f10be{i:010x}", sandbox_id="sbx-bench", decision="deny",
        reason="host_not_allowed", policy_name="bench", policy_hash="sha256:" + "ab" * 32,
        target_as_sent="denied.example.org", scheme="dns", host="denied.example.org", qtype="A", answers=[],
        client_address="127.0.0.2", duration_ms=0.0318 + i * 1e-9,
        message="denied.example.org is not in policy 'bench''s DNS allowlist; only listed names resolve.",
        extra={"egressgate.dns.rcode": "NXDOMAIN", "egressgate.dns.transport": "udp", "egressgate.dns.stage": "decide",
               "egressgate.state.admitted_at": 1795962789.25, "egressgate.state.dns_queries": i,
               "egressgate.state.dns_name_bytes": 18 * i},
    )


def best_us(fn, items) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for item in items:
            fn(item)
        best = min(best, time.process_time() - start)
    return best / len(items) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    for name, make in (("http_request", http_event), ("dns_query", dns_event)):
        events = [make(i) for i in range(args.n)]
        build = best_us(record_from_event, events)
        records = [record_from_event(e) for e in events]
        chain = ChainWriter()
        encode = best_us(chain.append, records)
        size = len(ChainWriter().append(record_from_event(events[0])))
        print(f"{name:13s} build {build:6.1f} us   encode+chain {encode:6.1f} us   {size} bytes/line")


if __name__ == "__main__":
    main()
