"""Decision overhead of an MCP `tools/call` (issue 13 goal: <= 0.3 ms p50 over the same POST without MCP rules).

`pure` (default): the CPU the policy engine adds per call, on a policy with one MCP server whose allowed tool
uses every kind of argument constraint (label equality, integer range, enum, anchored pattern, path prefix,
a URL checked with the sandbox's own network policy) — the most expensive allowed call — plus a denied
call (argument outside its range) and an unlisted tool. When egressgate/mcp/jsonrpc.py is present, a
second row adds the strict parse of the JSON-RPC body and the canonical re-serialization of the forwarded
message, i.e. everything the mediator computes per call apart from the state store and the audit write.

Each sample times a batch of calls with perf_counter_ns and divides (timer overhead does not dominate).
Run: `PYTHONPATH=$PWD .venv/bin/python -m loadtests.mcp_bench [--batches 300 --batch 200]`.

`gateway`: the issue's figure through the real gateway. One `egressgate run` (loopback, audit to a file)
serves two sandboxes whose policies allow the same `POST https://localhost:PORT/mcp` and differ only in an
`mcp` section naming that URL as an MCP server (the same tool and constraints as above, minus the label
check). A keep-alive client (one CONNECT + TLS per cell) sends the same `tools/call` body sequentially
(c=1) through each, alternating cells per repeat; the upstream (in this process, its own thread) answers
a fixed JSON-RPC result. Overhead = median p50 (MCP) - median p50 (plain); every answer must be 200 and
carry the upstream's `result` (a gateway denial would be a JSON-RPC `error`). Also printed: the paired
overhead (MCP minus plain within each repeat, median over repeats: the load drifts between repeats on a
shared machine), audit records per request of each cell, and the load average at start and end.
Run: `PYTHONPATH=$PWD .venv/bin/python -m loadtests.mcp_bench gateway [--seconds 4 --repeats 5]`.

`ab --base TREE`: this tree and another one, two gateways side by side in one run, cells interleaved
(loadtests/mcp_bench_ab.py): the before/after figure on a loaded machine.

`mediator`: the gateway's MCP work per call without mitmproxy: McpSession.from_client (strict parse,
decision, budget counts, the durable mcp_tool_call record) and from_server_bytes (answer read, outcome
record queued), in-process, memory state store, the real file audit sink; 2000 sequential calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from egressgate.policy.loader import parse_policy
from egressgate.policy.mcp_decide import McpFacts, ToolCall, decide_tool_call

NOW = 1_700_000_000.0
POLICY = """
sandbox: {name: bench}
network:
  https:
    allow:
      - host: tickets.mcp.test
        paths: ["/mcp"]
      - host: docs.example.com
        methods: [GET]
%(extra_rules)s
mcp:
  servers:
    - name: tickets
      url: https://tickets.mcp.test/mcp
      budget: {calls: 1000}
      tools:
        allow:
          - name: search_tickets
            budget: {calls: 100}
            arguments:
              project: {equals_label: tenant, required: true}
              limit: {type: integer, min: 1, max: 50}
              status: {enum: [open, closed]}
              query: {type: string, pattern: "^[a-z ]{1,40}$", max_length: 40}
              path: {path_prefix: /workspace/}
              url: {allowed_by_network: true}
        deny: [delete_ticket]
"""
ARGS = {"project": "acme", "limit": 10, "status": "open", "query": "printer on fire",
        "path": "/workspace/reports/q3.csv", "url": "https://docs.example.com/runbook"}
CASES = {
    "allowed (6 constraints)": ("search_tickets", ARGS),
    "denied (limit out of range)": ("search_tickets", {**ARGS, "limit": 500}),
    "unlisted tool": ("drop_tables", {}),
}


def build_policy(extra_rules: int):
    rules = "\n".join(f"      - {{host: host{i}.example.net, methods: [GET]}}" for i in range(extra_rules))
    return parse_policy(POLICY % {"extra_rules": rules}, f"<mcp bench {extra_rules}>")


def facts() -> McpFacts:
    return McpFacts("bench", {"tenant": "acme"}, 10, 3, None, None, None, None)


def per_call_us(fn: Callable[[], object], batches: int, batch: int) -> tuple[float, float]:
    samples = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - start) / batch / 1000)
    samples.sort()
    return statistics.median(samples), samples[max(0, int(len(samples) * 0.99) - 1)]


def _mediator_steps():
    """(parse, dumps) of egressgate/mcp/jsonrpc.py when it exists (h13-core), else None."""
    try:
        from egressgate.mcp.jsonrpc import dumps, parse_body
    except ImportError:
        return None
    return parse_body, dumps


def run(batches: int, batch: int, extra_rules: int) -> list[dict]:
    policy = build_policy(extra_rules)
    f = facts()
    rows = []
    for name, (tool, args) in CASES.items():
        call = ToolCall("tickets", tool, args)
        decision = decide_tool_call(policy, call, f, NOW)
        p50, p99 = per_call_us(lambda c=call: decide_tool_call(policy, c, f, NOW), batches, batch)
        rows.append({"what": f"decide_tool_call, {name}", "decision": f"{decision.decision} {decision.reason}",
                     "p50_us": round(p50, 2), "p99_us": round(p99, 2)})
    steps = _mediator_steps()
    if steps is not None:
        parse_body, dumps = steps
        body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                           "params": {"name": "search_tickets", "arguments": ARGS}}).encode()

        def mediate() -> bytes:
            messages, _ = parse_body(body, max_bytes=policy.mcp.max_message_bytes)
            params = messages[0].params
            decide_tool_call(policy, ToolCall("tickets", params["name"], params["arguments"]), f, NOW)
            return dumps(messages[0].obj)

        p50, p99 = per_call_us(mediate, batches, batch)
        rows.append({"what": "strict parse + decide_tool_call + canonical re-serialization (allowed)",
                     "decision": "allow", "p50_us": round(p50, 2), "p99_us": round(p99, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", choices=["pure", "mediator", "gateway", "ab"], default="pure")
    parser.add_argument("--base", help="ab: the other source tree (e.g. `git archive main` unpacked)")
    parser.add_argument("--seconds", type=float, default=4.0, help="gateway: seconds per cell")
    parser.add_argument("--repeats", type=int, default=5, help="gateway: repeats (cells alternate)")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--extra-rules", type=int, default=100, help="other network rules in the policy")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.mode == "mediator":
        from loadtests.mcp_bench_gateway import mediator_main

        mediator_main()
        return
    if args.mode == "ab":
        from loadtests.mcp_bench_ab import ab_main

        ab_main(args.base, args.seconds, args.repeats)
        return
    if args.mode == "gateway":
        from loadtests.mcp_bench_gateway import gateway_main

        gateway_main(args.seconds, args.repeats, as_json=args.json)
        return
    rows = run(args.batches, args.batch, args.extra_rules)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        print(f"{row['what']:<75} {row['decision']:<32} p50 {row['p50_us']:>7} us  p99 {row['p99_us']:>7} us")


if __name__ == "__main__":
    main()
