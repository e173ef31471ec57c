"""`python -m loadtests.mcp_bench ab --base TREE`: the MCP decision overhead of two source trees side by side.

Why: on this shared 2-core machine the load drifts by several ms of p50 between runs a minute apart, so
two `mcp_bench gateway` runs (one per tree) cannot resolve a 0.1 ms change. Here ONE harness starts two
gateways at once — this tree's and `TREE`'s (`git archive` of the base; the same venv, PYTHONPATH=TREE
for its process only) — with the same two sandbox policies (loadtests/mcp_bench_gateway.policy), and
runs the four cells (tree x plain/MCP) in short alternating slices, the order reversed every repeat, so
both trees see the same load. Per tree: median over repeats of the paired overhead (MCP p50 minus
plain p50 of the same repeat) and of the gateway CPU per request; audit records per request.
Loopback only, as mcp_bench_gateway.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from loadtests import procs
from loadtests.loadgen import Target
from loadtests.mcp_bench_gateway import JsonRpcUpstream, _cell, _load, policy


def _gateway(d: Path, certs: procs.Certs, port: int, env: dict[str, str] | None) -> procs.Proc:
    (d / "policies").mkdir(parents=True)
    for name, with_mcp in (("mcpbench-plain", False), ("mcpbench-mcp", True)):
        (d / "policies" / f"{name}.yaml").write_text(yaml.safe_dump(policy(name, port, with_mcp)))
    listen = {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None}
    return procs.launch_egressgate(d, certs.ca_pem, listen, {"plain": "mcpbench-plain", "mcp": "mcpbench-mcp"}, env=env)


def ab_main(base: str, seconds: float, repeats: int) -> None:
    procs.check_loopback_name()
    print(f"load at start: {_load()}", flush=True)
    rows: list[dict] = []
    audits: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="e25-mcp-ab-") as tmp:
        d = Path(tmp)
        certs = procs.make_certs(d)
        up = JsonRpcUpstream(certs)
        gws: dict[str, procs.Proc] = {}
        try:
            gws["base"] = _gateway(d / "base", certs, up.port, {**os.environ, "PYTHONPATH": str(Path(base).resolve())})
            gws["this"] = _gateway(d / "this", certs, up.port, None)
            cells = [(tree, label) for tree in ("base", "this") for label in ("plain", "mcp")]
            for rep in range(repeats):
                for tree, label in cells if rep % 2 == 0 else cells[::-1]:
                    gw = gws[tree]
                    target = Target(
                        scheme="https",
                        host=procs.UPSTREAM_NAME,
                        port=up.port,
                        dial=("127.0.0.1", gw.info["port"]),
                        via_proxy=True,
                        ca_file=gw.info["ca"],
                        proxy_auth=gw.info[label],
                        path="/mcp",
                    )
                    cpu0 = gw.cpu_seconds()
                    lat = asyncio.run(_cell(target, seconds))
                    cpu = gw.cpu_seconds() - cpu0
                    rows.append(
                        {
                            "rep": rep,
                            "tree": tree,
                            "label": label,
                            "n": len(lat),
                            "p50_ms": statistics.median(lat),
                            "cpu_ms": cpu * 1000 / len(lat),
                        }
                    )
                print(f"rep {rep + 1}/{repeats} done, load {_load()}", file=sys.stderr, flush=True)
            for tree, gw in gws.items():
                audits[tree] = Path(gw.info["audit"]).read_text(errors="replace")
        finally:
            for gw in gws.values():
                gw.stop()
            up.stop()
    print(f"load at end: {_load()}")

    def at(tree: str, label: str, rep: int, key: str) -> float:
        return next(r[key] for r in rows if (r["tree"], r["label"], r["rep"]) == (tree, label, rep))

    for tree in ("base", "this"):
        paired = {
            key: statistics.median(at(tree, "mcp", rep, key) - at(tree, "plain", rep, key) for rep in range(repeats))
            for key in ("p50_ms", "cpu_ms")
        }
        med = {
            label: {
                key: statistics.median(at(tree, label, rep, key) for rep in range(repeats))
                for key in ("p50_ms", "cpu_ms")
            }
            for label in ("plain", "mcp")
        }
        lines = audits[tree].splitlines()
        per_req = {
            label: sum(f'"mcpbench-{label}"' in line for line in lines)
            / max(1, sum(r["n"] for r in rows if (r["tree"], r["label"]) == (tree, label)))
            for label in ("plain", "mcp")
        }
        print(
            f"{tree:4}: plain p50 {med['plain']['p50_ms']:.3f} ms CPU {med['plain']['cpu_ms']:.3f} ms/req | MCP p50 "
            f"{med['mcp']['p50_ms']:.3f} ms CPU {med['mcp']['cpu_ms']:.3f} ms/req | paired overhead p50 "
            f"{paired['p50_ms']:+.3f} ms, CPU {paired['cpu_ms']:+.3f} ms/req (goal p50 <= 0.3) | records/request "
            f"plain {per_req['plain']:.2f} MCP {per_req['mcp']:.2f}"
        )
