"""Decisions per second of the pure engine with 10 and 10,000 host rules.

Goal (issue 2): p50 <= 10 us per decision at 10,000 rules. Run: `.venv/bin/python -m loadtests.decide_bench`.
`--classify` (issue 22): also times classify() + decide() as the gateway runs them per HTTP request (the
operation class, policy/opclass.py), interleaved batch by batch with plain decide() on the same requests,
over the usual mix and over a mix where every 3rd request is a package install or a publish; the goal is
<= 5 us p50 added.
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
from dataclasses import replace
from urllib.parse import urlsplit

from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.opclass import classify
from egressgate.policy.target import parse_target

NOW = 1_700_000_000.0


def build_policy(n_rules: int):
    lines = [
        "sandbox: {name: bench}",
        "network:",
        "  https:",
        "    deny:",
        "      - {id: d0, host: '*', methods: [DELETE]}",
        "    allow:",
    ]
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


PACKAGE_TEXTS = (
    "GET https://a.b.svc{i}.example.com/simple/pkg{i}/",
    "GET https://a.b.svc{i}.example.com/packages/ab/cd/pkg{i}-1.0-py3-none-any.whl",
    "POST https://api{j}.example.com/v2/acme/app/blobs/uploads/",
    "GET https://a.b.svc{i}.example.com/left-pad/-/left-pad-1.3.0.tgz",
)


def _raw(text: str) -> tuple[str, str, str | None]:
    method, url = text.split()
    parts = urlsplit(url)
    return method, parts.path or "/", parts.query or None


def measure_classify(n_rules: int, package_share: bool, batches: int = 400, batch: int = 100) -> dict:
    """p50 of decide() alone vs classify() + decide() on the same requests, batches interleaved."""
    policy = build_policy(n_rules)
    rng = random.Random(11)
    texts = []
    for k, facts in enumerate(build_requests(n_rules)):
        if package_share and k % 3 == 0:
            i = rng.randrange(n_rules)
            texts.append(PACKAGE_TEXTS[k % len(PACKAGE_TEXTS)].format(i=i - i % 4, j=i - i % 4 + 1))
        else:
            texts.append(f"{facts.method} https://{facts.host}{facts.path}")
    plain = [replace(parse_target(t), op_class=None, op_protocol=None) for t in texts]  # as before issue 22
    raw = [_raw(t) for t in texts]
    classified = []
    for facts, (method, path, query) in zip(plain, raw, strict=True):
        op = classify(method, path, query, None, "*/*")
        # an unclassified request is the same Facts object in both variants: only classify() differs
        classified.append(facts if op is None else replace(facts, op_class=op[0], op_protocol=op[1]))
    state = SandboxState(sandbox_id="bench", admitted_at=NOW - 1)

    def time_plain(idx: list[int]) -> float:
        start = time.perf_counter_ns()
        for x in idx:
            decide(policy, plain[x], state, NOW)
        return (time.perf_counter_ns() - start) / len(idx) / 1000

    def time_both(idx: list[int]) -> float:
        start = time.perf_counter_ns()
        for x in idx:
            method, path, query = raw[x]
            classify(method, path, query, None, "*/*")
            decide(policy, classified[x], state, NOW)
        return (time.perf_counter_ns() - start) / len(idx) / 1000

    base, both, alone = [], [], []
    k = 0
    for n in range(batches):
        idx = [(k + j) % len(plain) for j in range(batch)]
        k += batch
        if n % 2:  # alternate which variant runs first: the second one finds the batch's data in cache
            both.append(time_both(idx))
            base.append(time_plain(idx))
        else:
            base.append(time_plain(idx))
            both.append(time_both(idx))
        start = time.perf_counter_ns()
        for x in idx:
            method, path, query = raw[x]
            classify(method, path, query, None, "*/*")
        alone.append((time.perf_counter_ns() - start) / batch / 1000)
    p50, p50c = statistics.median(base), statistics.median(both)
    return {
        "rules": n_rules,
        "mix": "with package/publish requests (1 in 3)" if package_share else "usual",
        "classified_share": round(sum(f.op_class is not None for f in classified) / len(classified), 2),
        "p50_decide_us": round(p50, 2),
        "p50_classify_decide_us": round(p50c, 2),
        "added_p50_us": round(p50c - p50, 2),
        # each batch's two timings are adjacent in time: the median of their differences is robust to load
        # phases on a shared machine (the difference of two medians is not)
        "added_paired_p50_us": round(statistics.median(b - a for a, b in zip(base, both, strict=True)), 2),
        "p50_classify_alone_us": round(statistics.median(alone), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rules", type=int, nargs="*", default=[10, 10_000])
    parser.add_argument("--classify", action="store_true", help="time classify() + decide() against decide()")
    args = parser.parse_args()
    for n in args.rules:
        if args.classify:
            for package_share in (False, True):
                print(json.dumps(measure_classify(n, package_share)))
        else:
            print(json.dumps(measure(n)))


if __name__ == "__main__":
    main()
