"""`make bench-state`'s outputs: the markdown table with issue 12's goals, a JSON dump, RESULTS.md.

Ratios are of medians over repeats, in the same mode and concurrency: redis / memory (what the shared
state costs one process), redis-2w / redis (what a second worker buys), each as rps and as requests per
gateway CPU-second (the gateway's whole process tree, from /proc). On a 2-core machine shared by client,
upstream, Redis and gateway, the rps ratio of two workers is capped by the cores left over; the per-CPU
figure says whether the second worker wastes CPU (it stays ~1.0 when workers scale).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from loadtests import state_procs
from loadtests.bench_report import _f, _goal

GOALS = {"redis_vs_memory": 0.9, "workers2_vs_1": 1.6, "budget_p99_us": 1000.0}
LABEL = {"memory": "memory, 1 process", "redis": "redis, 1 process", "redis-2w": "redis, --workers 2",
         "redis-setsid": "redis, 1 process, own session", "memory-base": "BASE tree: memory, 1 process",
         "redis-base": "BASE tree: redis, 1 process"}


def summarize(rows: list[dict]) -> list[dict]:
    """Medians per (mode, concurrency, candidate) over the repeats, and what each request cost Redis."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["mode"], r["conc"], r["candidate"]), []).append(r)
    out = []
    for (mode, conc, cand), rs in cells.items():
        ok = [x for x in rs if "rps" in x]

        def med(key: str, xs: list[dict] = ok) -> float | None:
            vals = [x[key] for x in xs if x.get(key) is not None]
            return statistics.median(vals) if vals else None

        per_req: dict[str, float] = {}
        for x in ok:
            for k, v in x.get("redis_commands", {}).items():
                per_req.setdefault(k, []).append(v / max(1, x["upstream_requests"]))  # type: ignore[attr-defined]
        lua = [x["redis_latency_usec"].get("evalsha", x["redis_latency_usec"].get("fcall", {})).get("p99")
               for x in ok if x.get("redis_latency_usec")]
        out.append({
            "mode": mode, "conc": conc, "candidate": cand, "runs": [round(x["rps"], 1) for x in ok],
            "rps": med("rps"), "p50_ms": med("p50_ms"), "p99_ms": med("p99_ms"),
            "gateway_cores": med("gateway_cores"), "client_cores": med("client_cores"),
            "redis_cores": med("redis_cores"), "client": ok[0]["client"] if ok else None,
            "cores_by_process": [statistics.median(v) for v in zip(*(x["cores_by_process"] for x in ok), strict=False)]
            if ok and all("cores_by_process" in x for x in ok) else [],
            # requests per gateway CPU-second: what a core buys, less sensitive to the CPU others take
            "req_per_cpu_s": statistics.median(x["rps"] / x["gateway_cores"] for x in ok)
            if ok and all(x["gateway_cores"] for x in ok) else None,
            "redis_round_trips_per_req": med("redis_round_trips_per_req"),
            "redis_calls_per_req": {k: round(statistics.median(v), 2) for k, v in sorted(per_req.items())},
            "redis_script_p99_us": statistics.median([v for v in lua if v is not None]) if any(lua) else None,
            "errors": sum(sum(x["errors"].values()) for x in ok) + sum(1 for x in rs if "failed" in x),
            "upstream_short": sum(1 for x in ok if x["upstream_requests"] < x["requests"]),
        })
    order = {c: i for i, c in enumerate(state_procs.CANDIDATES)}
    out.sort(key=lambda s: (s["mode"], s["conc"], order[s["candidate"]]))
    return out


def ratios(summary: list[dict]) -> list[dict]:
    by = {(s["mode"], s["conc"], s["candidate"]): s for s in summary}
    out = []
    for mode, conc in sorted({(s["mode"], s["conc"]) for s in summary}):
        def div(a: str, b: str, key: str, mode: str = mode, conc: int = conc) -> float | None:
            x, y = by.get((mode, conc, a), {}).get(key), by.get((mode, conc, b), {}).get(key)
            return x / y if x and y else None

        out.append({"mode": mode, "conc": conc,
                    "redis_vs_memory": div("redis", "memory", "rps"),
                    "redis_vs_memory_per_cpu": div("redis", "memory", "req_per_cpu_s"),
                    "w2_vs_w1": div("redis-2w", "redis", "rps"),
                    "w2_vs_w1_per_cpu": div("redis-2w", "redis", "req_per_cpu_s"),
                    "w2_vs_memory": div("redis-2w", "memory", "rps"),
                    "base_redis_vs_memory": div("redis-base", "memory-base", "rps"),
                    "redis_vs_base": div("redis", "redis-base", "rps"),
                    "memory_vs_base": div("memory", "memory-base", "rps")})
    return out


def _calls(s: dict) -> str:
    c = s.get("redis_calls_per_req") or {}
    return ", ".join(f"{k} {v:g}" for k, v in c.items() if v >= 0.01) or "-"


def _split(s: dict) -> str:
    """Per-process cores when the gateway is several processes (supervisor + workers), busiest first."""
    c = s.get("cores_by_process") or []
    return f" ({' + '.join(f'{x:.2f}' for x in c)})" if len(c) > 1 else ""


def markdown(report: dict) -> str:
    m = report["meta"]
    ls, le, lr = m["load_start"], m["load_end"], m["load_run"]
    lines = [
        f"### `make bench-state` run (issue 12), {m['started']}, tree {m['git']}",
        "",
        f"Command: `{m['command']}` · mitmproxy {m['mitmproxy']} · redis-py {m['redis_py']} · Python {m['python']} "
        f"· {ls['cpus']} CPUs · plain-HTTP client: {report.get('http_client', '?')}, HTTPS client: "
        "loadtests/loadgen.py",
        "",
        f"Load: start loadavg {' '.join(f'{x:.2f}' for x in ls['loadavg'])}, others {ls['others_pct']}% / steal "
        f"{ls['steal_pct']}% (1 s idle sample) · end loadavg {' '.join(f'{x:.2f}' for x in le['loadavg'])}, "
        f"others {le['others_pct']}% / steal {le['steal_pct']}% · during the run ({lr['wall_s']} s) others used "
        f"{lr['others_cores']} cores (the bench {lr['bench_cores']}), steal {lr['steal_pct']}%.",
        "",
        ("**Noisy run, compare with care:** " + "; ".join(m["noisy"]) + ".") if m.get("noisy")
        else "Quiet enough: no other load above the thresholds of loadtests/bench_load.py.",
        "",
        "| mode | conc | gateway | rps (median) | rps per run | p50 ms | p99 ms | gateway cores (per process) | "
        "req per gateway CPU-s | client cores | Redis cores | Redis round trips per request | Redis commands per "
        "request (incl. inside scripts) | errors |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for s in report["summary"]:
        lines.append(
            f"| {s['mode']} | {s['conc']} | {LABEL[s['candidate']]} | {_f(s['rps'])} | "
            f"{' / '.join(f'{x:.0f}' for x in s['runs'])} | {_f(s['p50_ms'], '.2f')} | {_f(s['p99_ms'], '.2f')} | "
            f"{_f(s['gateway_cores'], '.2f')}{_split(s)} | {_f(s['req_per_cpu_s'])} | {_f(s['client_cores'], '.2f')} | "
            f"{_f(s['redis_cores'], '.2f')} | {_f(s.get('redis_round_trips_per_req'), '.2f')} | {_calls(s)} | "
            f"{s['errors']} |")
    lines += ["", f"| mode | conc | redis / memory rps (goal >= {GOALS['redis_vs_memory']}x) | same, per gateway "
              f"CPU-s | --workers 2 / 1 rps (goal >= {GOALS['workers2_vs_1']}x at c=32) | same, per gateway CPU-s "
              "| --workers 2 (redis) / memory 1 process rps |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in ratios(report["summary"]):
        w2_goal = _goal(r["w2_vs_w1"], GOALS["workers2_vs_1"]) if r["conc"] >= 32 else ""
        lines.append(f"| {r['mode']} | {r['conc']} | {_f(r['redis_vs_memory'], '.2f', 'x')}"
                     f"{_goal(r['redis_vs_memory'], GOALS['redis_vs_memory'])} | "
                     f"{_f(r['redis_vs_memory_per_cpu'], '.2f', 'x')} | {_f(r['w2_vs_w1'], '.2f', 'x')}{w2_goal} | "
                     f"{_f(r['w2_vs_w1_per_cpu'], '.2f', 'x')} | {_f(r['w2_vs_memory'], '.2f', 'x')} |")
    if any(r["base_redis_vs_memory"] or r["redis_vs_base"] for r in ratios(report["summary"])):
        lines += ["", "Before/after (the *-base candidates run the `--base-src` tree, interleaved with this one):", "",
                  "| mode | conc | BASE redis / BASE memory rps | redis / memory rps (this tree) | redis: this tree / "
                  "BASE rps | memory: this tree / BASE rps |", "|---|---:|---:|---:|---:|---:|"]
        for r in ratios(report["summary"]):
            lines.append(f"| {r['mode']} | {r['conc']} | {_f(r['base_redis_vs_memory'], '.2f', 'x')} | "
                         f"{_f(r['redis_vs_memory'], '.2f', 'x')} | {_f(r['redis_vs_base'], '.2f', 'x')} | "
                         f"{_f(r['memory_vs_base'], '.2f', 'x')} |")
    lua = [(s["mode"], s["conc"], s["candidate"], s["redis_script_p99_us"]) for s in report["summary"]
           if s.get("redis_script_p99_us") is not None]
    if lua:
        lines += ["", "Redis server-side p99 of the Lua scripts (EVALSHA, INFO latencystats) during the gateway "
                  "cells: " + "; ".join(f"{m_} c={c} {n} {v:.0f} µs" for m_, c, n, v in lua) + "."]
    budget = report.get("budget") or []
    if budget:
        lines += ["", f"Budget check (`reserve_out`, caller-side, loadtests/budget_check_bench.py in the gateway "
                  f"namespace; goal p99 <= {GOALS['budget_p99_us']:.0f} µs on loopback Redis; with 32 concurrent "
                  "callers on one event loop a call also waits for the other callers' turns: that row shows "
                  "queueing, not the script):", "",
                  "| case | calls | p50 µs | p90 µs | p99 µs | p99.9 µs | max µs | settle_out p99 µs | caller CPU µs "
                  "per reserve+settle |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for b in budget:
            if "error" in b:
                lines.append(f"| {b['case']} | not available: {b['error'][:200]} | | | | | | | |")
                continue
            r, st = b["reserve_out"], b["settle_out"]
            goal = _goal(r["p99_us"], GOALS["budget_p99_us"], higher=False) if b["case"].startswith("redis") else ""
            lines.append(f"| {b['case']} | {r['calls']} | {r['p50_us']:.1f} | {r['p90_us']:.1f} | "
                         f"{r['p99_us']:.1f}{goal} | {r['p999_us']:.1f} | {r['max_us']:.0f} | {st['p99_us']:.1f} | "
                         f"{b.get('cpu_us_per_pair', '-')} |")
    for name, prof in (report.get("profiles") or {}).items():
        if "error" in prof:
            lines += ["", f"Profile of `{name}`: not available ({prof['error']})."]
            continue
        comps = ", ".join(f"{k} {v}%" for k, v in prof["components_self_pct"].items() if v >= 1.0)
        tops = "; ".join(f"{w} {p_}%" for w, p_, _us, _n in prof["top_self"][:8])
        state = "; ".join(f"{w} {us} µs x{n}" for w, us, n in prof["state_inclusive"][:5]) or "-"
        lines += ["", f"Profile of `{name}` ({prof.get('processes', 1)} process(es) under cProfile, "
                  f"{'; '.join(prof['cells'])}; {prof.get('us_per_request', '-')} µs busy per request under the "
                  f"profiler; self time, % of {prof['busy_s']} busy s): {comps}. Top functions: {tops}. State "
                  f"calls (inclusive, profiled; cProfile counts each coroutine resumption as a call): {state}."]
    for name, why in report.get("unavailable", {}).items():
        lines += ["", f"{name}: not available ({why[:300]})."]
    return "\n".join(lines)


def write(report: dict, md: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / ("bench-state-" + time.strftime("%Y%m%dT%H%MZ", time.gmtime()))
    paths = [stem.with_suffix(".md"), stem.with_suffix(".json")]
    paths[0].write_text(md + "\n")
    paths[1].write_text(json.dumps(report, indent=1, default=str) + "\n")
    return paths
