"""Gateway CPU per request, this tree against another (A/B), at c=1: the figure that a loaded machine blurs least.

    PYTHONPATH=$PWD .venv/bin/python -m loadtests.cpu_ab --baseline /tmp/base [--rounds 8] [--concurrency 1]

Starts the upstream and two `egressgate run` gateways (this tree, and the `--baseline` tree: `git archive
<commit> egressgate | tar -x -C DIR`) as loadtests/gateway_bench.py does, then runs keep-alive 1 KiB GETs
at c=1 (`--concurrency`) against each in turn, `--rounds` times per mode, the order alternating, and reads
each gateway's own CPU time (utime + stime, /proc) around every cell. Why: on a machine other jobs
saturate, rps and p50 say mostly how much CPU the gateway was given (loadtests/RESULTS.md: per-repeat rps
spread 5-10x); the CPU time the gateway spends per request depends more on what it does. Printed: median
µs of gateway CPU per request for each tree, and the median of the per-round ratios (this / baseline).
Each cell's CPU includes its connection set-up (TLS handshake, warm-up requests): the same for both trees.
Caveat (RESULTS.md, h-hop2): on a saturated machine a starved cell still costs more CPU per request.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from loadtests import procs
from loadtests.gateway_bench import Bench
from loadtests.loadgen import run_cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["http", "https"], choices=["http", "https"])
    args = ap.parse_args()
    ns = argparse.Namespace(upstream_host=procs.UPSTREAM_NAME, baseline=args.baseline, mitmdump_flow_detail=0)
    bench = Bench(ns, Path(tempfile.mkdtemp(prefix="egressgate-cpu-ab-")))
    names = ["egressgate", "egressgate-base"]
    try:
        bench.start(names)
        if bench.unavailable:
            sys.exit(f"not started: {bench.unavailable}")
        for mode in args.modes:
            per: dict[str, list[float]] = {n: [] for n in names}
            p50: dict[str, list[float]] = {n: [] for n in names}
            ratios = []
            for rnd in range(args.rounds):
                order = names if rnd % 2 == 0 else names[::-1]
                got = {}
                for name in order:
                    proc = bench.procs[name]
                    target = bench.target(name, mode)
                    cpu0 = proc.cpu_seconds()
                    res = run_cell(target, args.concurrency, args.seconds)
                    cpu = proc.cpu_seconds() - cpu0
                    if res.ok:
                        got[name] = 1e6 * cpu / res.ok
                        per[name].append(got[name])
                        p50[name].append(res.p50_ms)
                    print(
                        f"{mode} round {rnd + 1} {name:16s} {res.ok:6d} requests  {got.get(name, 0):7.1f} µs CPU "
                        f"per request  p50 {res.p50_ms:6.2f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
                if len(got) == 2:
                    ratios.append(got["egressgate"] / got["egressgate-base"])
            new, base = statistics.median(per["egressgate"]), statistics.median(per["egressgate-base"])
            print(
                f"{mode}: gateway CPU per request, median of {args.rounds} rounds: this tree {new:.1f} µs, "
                f"baseline {base:.1f} µs; per-round ratio this/baseline: median {statistics.median(ratios):.3f} "
                f"(range {min(ratios):.3f}-{max(ratios):.3f}); p50 median "
                f"{statistics.median(p50['egressgate']):.2f} / {statistics.median(p50['egressgate-base']):.2f} ms"
            )
    finally:
        bench.stop()


if __name__ == "__main__":
    main()
