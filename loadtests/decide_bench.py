"""Decisions per second of the pure engine with 10 and 10,000 host rules.

Goal (issue 2): p50 <= 10 us per decision at 10,000 rules. Run: `.venv/bin/python -m loadtests.decide_bench`.
Each sample times a batch of decisions with perf_counter_ns and divides, so timer overhead does not
dominate; the p50/p99 are over batches of mixed allowed/denied requests (exact hosts, wildcard
subdomains, paths with globs, misses).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.target import parse_target

NOW = 1_700_000_000.0


def build_policy(n_rules: int):
    lines = ["sandbox: {name: bench}", "network:", "  https:", "    deny:",
             "      - {id: d0, host: '*', methods: [DELETE]}", "    allow:"]
    for i in range(n_rules):
        if i % 4 == 0:
            lines.append(f"      - {{host: '*.svc{i}.example.com', methods: [GET]}}")
        elif i % 4 == 1:
            lines.append(f"      - {{host: api{i}.example.com, methods: [POST], paths: ['/v1/*/items', '/v2/**']}}")
        else:
            lines.append(f"      - {{host: host{i}.example.com, methods: [GET, HEAD], paths: ['/x']}}")
    return parse_policy("\n".join(lines) + "\n", f"<bench {n_rules}>")


def build_requests(n_rules: int, count: int = 2000):
    rng = random.Random(7)
    texts = []
    for _ in range(count):
        i = rng.randrange(n_rules)
        kind = rng.randrange(5)
        if kind == 0:
            texts.append(f"GET https://a.b.svc{i - i % 4}.example.com/anything")
        elif kind == 1:
            texts.append(f"POST https://api{i - i % 4 + 1}.example.com/v1/abc/items")
        elif kind == 2:
            texts.append(f"GET https://host{i - i % 4 + 2}.example.com/x")
        elif kind == 3:
            texts.append(f"GET https://host{i - i % 4 + 2}.example.com/denied-path")
        else:
            texts.append(f"GET https://unknown{i}.example.org/")
    return [parse_target(t) for t in texts]


def measure(n_rules: int, batches: int = 200, batch: int = 100) -> dict:
    policy = build_policy(n_rules)
    facts = build_requests(n_rules)
    state = SandboxState(sandbox_id="bench", admitted_at=NOW - 1)
    allowed = sum(decide(policy, f, state, NOW).allowed for f in facts)
    per_decision = []
    k = 0
    for _ in range(batches):
        chunk = [facts[(k + j) % len(facts)] for j in range(batch)]
        k += batch
        start = time.perf_counter_ns()
        for f in chunk:
            decide(policy, f, state, NOW)
        per_decision.append((time.perf_counter_ns() - start) / batch / 1000)
    per_decision.sort()
    return {
        "rules": n_rules,
        "p50_us": round(statistics.median(per_decision), 2),
        "p99_us": round(per_decision[int(len(per_decision) * 0.99) - 1], 2),
        "decisions_per_s": round(1e6 / statistics.median(per_decision)),
        "allowed_share": round(allowed / len(facts), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rules", type=int, nargs="*", default=[10, 10_000])
    args = parser.parse_args()
    for n in args.rules:
        print(json.dumps(measure(n)))


if __name__ == "__main__":
    main()
