"""Paired figures of a `make bench-state` JSON with the *-base candidates (`--base-src`): medians of p50 per
candidate, and per-repeat ratios (redis / memory measured adjacent in time within one repeat, then the median
over repeats), which hold up better than rps medians when other load swings between repeats.

    .venv/bin/python -m loadtests.state_pairs loadtests/results/bench-state-<UTC>.json
"""

from __future__ import annotations

import json
import statistics
import sys

CANDS = ("memory", "redis", "memory-base", "redis-base")


def table(report: dict) -> str:
    rows = [r for r in report["rows"] if r.get("rps")]
    by = {(r["rep"], r["mode"], r["conc"], r["candidate"]): r for r in rows}
    reps = sorted({r["rep"] for r in rows})
    out = [
        "| mode | conc | p50 ms memory / redis / BASE memory / BASE redis (medians) | added p50 over memory: "
        "redis / "
        "BASE redis | paired rps ratio redis/memory (median of reps) | same, BASE | paired rps redis / BASE redis |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for mode, conc in sorted({(r["mode"], r["conc"]) for r in rows}):

        def med(c: str, mode: str = mode, conc: int = conc) -> float:
            return statistics.median(by[(k, mode, conc, c)]["p50_ms"] for k in reps if (k, mode, conc, c) in by)

        def pair(a: str, b: str, mode: str = mode, conc: int = conc) -> float:
            return statistics.median(
                by[(k, mode, conc, a)]["rps"] / by[(k, mode, conc, b)]["rps"]
                for k in reps
                if (k, mode, conc, a) in by and (k, mode, conc, b) in by
            )

        p = {c: med(c) for c in CANDS}
        out.append(
            f"| {mode} | {conc} | {' / '.join(f'{p[c]:.2f}' for c in CANDS)} | "
            f"{p['redis'] - p['memory']:+.2f} / {p['redis-base'] - p['memory-base']:+.2f} | "
            f"{pair('redis', 'memory'):.2f}x | {pair('redis-base', 'memory-base'):.2f}x | "
            f"{pair('redis', 'redis-base'):.2f}x |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table(json.load(f)))
