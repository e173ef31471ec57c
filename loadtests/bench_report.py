"""`make bench`'s outputs: a markdown table with the issue-11 ratios, a JSON dump, a PNG plot, RESULTS.md.

Ratios are of medians over repeats, each against the right reference: egressgate / bare mitmdump in the same
mode and concurrency (what the gateway costs over the tool it embeds), passthrough / Squid's CONNECT tunnel
(both splice TLS they do not terminate), egressgate's MITM / Squid's ssl-bump MITM (both terminate TLS and
relay HTTP: the C reference; issue 25's goal is >= 0.5x at c=32), and added p50 = candidate p50 - direct p50
(what a hop costs).
The PNG needs matplotlib (the `bench` extra: `pip install -e '.[bench]'`, which `make bench` does); without
it the run still writes the table and says why there is no plot.
"""

from __future__ import annotations

import json
import subprocess
import time
from importlib import metadata
from pathlib import Path

LABEL = {
    ("direct", "http"): "direct", ("direct", "https"): "direct (TLS)",
    ("squid", "http"): "squid (forward)", ("squid", "https"): "squid (CONNECT tunnel)",
    ("squid-bump", "https"): "squid (ssl-bump MITM)",
    ("mitmdump", "http"): "mitmdump", ("mitmdump", "https"): "mitmdump (MITM)",
    ("egressgate", "http"): "egressgate (plain HTTP)", ("egressgate", "https"): "egressgate (MITM)",
    ("egressgate-pt", "https"): "egressgate (passthrough)",
    ("egressgate-base", "http"): "egressgate, baseline tree (plain HTTP)",
    ("egressgate-base", "https"): "egressgate, baseline tree (MITM)",
}
BULK_LABEL = {"direct": "direct (TLS)", "squid": "squid (CONNECT tunnel)", "egressgate": "egressgate (MITM)",
              "egressgate-pt": "egressgate (passthrough)"}
COLOR = {"direct": "#7f7f7f", "squid": "#2ca02c", "squid-bump": "#17becf", "mitmdump": "#1f77b4",
         "egressgate": "#d62728", "egressgate-pt": "#ff7f0e", "egressgate-base": "#9467bd"}
GOALS = {"vs_mitmdump": 1.1, "added_p50_ms": 1.0, "pt_vs_squid": 0.5, "rss_mb": 180.0, "vs_squid_bump": 0.5}
BUMP_GOAL_CONC = 32  # issue 25: egressgate's MITM rate >= 0.5x Squid ssl-bump's at c=32


def git_state(root: Path) -> str:
    """HEAD, and how many files under egressgate/ differ from it (figures belong to a tree, not a commit)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--short", "egressgate"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if not head:
        return "unknown (not a git checkout)"
    return head + (f" (+{len(dirty)} uncommitted files under egressgate/)" if dirty else "")


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def squid_version() -> str:
    try:
        out = subprocess.run(["squid", "-v"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return "not installed"
    return out.split("Version", 1)[1].split()[0] if "Version" in out else "?"


def _f(x: float | None, fmt: str = ".0f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def _goal(value: float | None, goal: float, higher: bool = True) -> str:
    if value is None:
        return ""
    return " (met)" if (value >= goal if higher else value <= goal) else " (**not met**)"


def ratios(summary: list[dict]) -> list[dict]:
    by = {(s["mode"], s["conc"], s["candidate"]): s for s in summary}
    out = []
    for mode, conc in sorted({(s["mode"], s["conc"]) for s in summary}):
        def get(cand: str, key: str, mode: str = mode, conc: int = conc) -> float | None:
            s = by.get((mode, conc, cand))
            return s[key] if s and s[key] is not None else None

        def div(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        def sub(a: float | None, b: float | None) -> float | None:
            return a - b if a is not None and b is not None else None

        out.append({"mode": mode, "conc": conc,
                    "eg_vs_mitmdump": div(get("egressgate", "rps"), get("mitmdump", "rps")),
                    "eg_vs_mitmdump_per_cpu": div(get("egressgate", "req_per_cpu_s"), get("mitmdump", "req_per_cpu_s")),
                    "eg_added_p50_ms": sub(get("egressgate", "p50_ms"), get("direct", "p50_ms")),
                    "mitmdump_added_p50_ms": sub(get("mitmdump", "p50_ms"), get("direct", "p50_ms")),
                    "pt_vs_squid": div(get("egressgate-pt", "rps"), get("squid", "rps")),
                    "pt_added_p50_ms": sub(get("egressgate-pt", "p50_ms"), get("direct", "p50_ms")),
                    "eg_vs_squid_bump": div(get("egressgate", "rps"), get("squid-bump", "rps")),
                    "eg_vs_squid_bump_per_cpu": div(get("egressgate", "req_per_cpu_s"),
                                                    get("squid-bump", "req_per_cpu_s")),
                    "squid_bump_added_p50_ms": sub(get("squid-bump", "p50_ms"), get("direct", "p50_ms")),
                    "eg_vs_base": div(get("egressgate", "rps"), get("egressgate-base", "rps")),
                    "eg_vs_base_per_cpu": div(get("egressgate", "req_per_cpu_s"),
                                              get("egressgate-base", "req_per_cpu_s")),
                    "base_added_p50_ms": sub(get("egressgate-base", "p50_ms"), get("direct", "p50_ms"))})
    return out


def bulk_summary(bulk: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for cand in BULK_LABEL:
        rs = [r for r in bulk if r["candidate"] == cand]
        if not rs:
            continue
        ok = [r for r in rs if r["ok"]]
        speeds = sorted(r["mib_per_s"] for r in ok)
        out[cand] = {"mib_per_s": speeds[len(speeds) // 2] if speeds else None, "runs": [r["mib_per_s"] for r in rs],
                     "failed": [r["error"] for r in rs if not r["ok"]],
                     "proxy_cpu_s": max((r["proxy_cpu_s"] for r in rs if r["proxy_cpu_s"] is not None), default=None),
                     "client": rs[0].get("client", "python"),
                     "peak_rss_mb": max((r["peak_rss_mb"] for r in rs if "peak_rss_mb" in r), default=None),
                     "rss_before_mb": max((r["rss_before_mb"] for r in rs if "rss_before_mb" in r), default=None)}
    return out


def markdown(report: dict) -> str:
    m = report["meta"]
    ls, le, lr = m["load_start"], m["load_end"], m["load_run"]
    lines = [
        f"### `make bench` run, {m['started']}, tree {m['git']}",
        "",
        f"Command: `{m['command']}` · mitmproxy {m['mitmproxy']} · Squid {m['squid']} · Python {m['python']} · "
        f"{ls['cpus']} CPUs",
        "",
        f"Load: start loadavg {' '.join(f'{x:.2f}' for x in ls['loadavg'])}, others {ls['others_pct']}% / steal "
        f"{ls['steal_pct']}% (1 s idle sample) · end loadavg {' '.join(f'{x:.2f}' for x in le['loadavg'])}, "
        f"others {le['others_pct']}% / steal {le['steal_pct']}% · during the run ({lr['wall_s']} s) others used "
        f"{lr['others_cores']} cores (the bench {lr['bench_cores']}), steal {lr['steal_pct']}%.",
        "",
        ("**Noisy run, compare with care:** " + "; ".join(m["noisy"]) + ".") if m.get("noisy")
        else "Quiet enough: no other load above the thresholds of loadtests/bench_load.py.",
        "",
        "| mode | conc | candidate | rps (median) | rps per run | p50 ms | p99 ms | proxy CPU | upstream conns "
        "| errors |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for s in report["summary"]:
        lines.append(f"| {s['mode']} | {s['conc']} | {LABEL[(s['candidate'], s['mode'])]} | {_f(s['rps'])} | "
                     f"{' / '.join(f'{x:.0f}' for x in s['runs'])} | {_f(s['p50_ms'], '.2f')} | "
                     f"{_f(s['p99_ms'], '.2f')} | {_f(s['proxy_cpu'], '.2f')} | {_f(s.get('upstream_conns'))} | "
                     f"{s['errors']} |")
    lines += ["", f"| mode | conc | egressgate / mitmdump rps (goal >= {GOALS['vs_mitmdump']}x) | same, per proxy "
              f"CPU-second | egressgate added p50 over direct (goal <= {GOALS['added_p50_ms']} ms at c=1) | mitmdump "
              f"added p50 | passthrough / squid CONNECT rps (goal >= {GOALS['pt_vs_squid']}x) "
              f"| passthrough added p50 | egressgate MITM / squid ssl-bump rps (goal >= {GOALS['vs_squid_bump']}x "
              f"at c={BUMP_GOAL_CONC}) | same, per proxy CPU-second | squid ssl-bump added p50 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ratios(report["summary"]):
        p50_goal = _goal(r["eg_added_p50_ms"], GOALS["added_p50_ms"], higher=False) if r["conc"] == 1 else ""
        bump_goal = _goal(r["eg_vs_squid_bump"], GOALS["vs_squid_bump"]) if r["conc"] == BUMP_GOAL_CONC else ""
        lines.append(
            f"| {r['mode']} | {r['conc']} | {_f(r['eg_vs_mitmdump'], '.2f', 'x')}"
            f"{_goal(r['eg_vs_mitmdump'], GOALS['vs_mitmdump'])} | {_f(r['eg_vs_mitmdump_per_cpu'], '.2f', 'x')} "
            f"| {_f(r['eg_added_p50_ms'], '.2f', ' ms')}{p50_goal} "
            f"| {_f(r['mitmdump_added_p50_ms'], '.2f', ' ms')} | {_f(r['pt_vs_squid'], '.2f', 'x')}"
            f"{_goal(r['pt_vs_squid'], GOALS['pt_vs_squid'])} | {_f(r['pt_added_p50_ms'], '.2f', ' ms')} "
            f"| {_f(r['eg_vs_squid_bump'], '.2f', 'x')}{bump_goal} | {_f(r['eg_vs_squid_bump_per_cpu'], '.2f', 'x')} "
            f"| {_f(r['squid_bump_added_p50_ms'], '.2f', ' ms')} |")
    base = [r for r in ratios(report["summary"]) if r["eg_vs_base"] is not None]
    if base:
        lines += ["", "| mode | conc | this tree / baseline tree rps | same, per proxy CPU-second "
                  "| added p50 over direct: this tree | baseline tree |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['mode']} | {r['conc']} | {_f(r['eg_vs_base'], '.2f', 'x')} | "
                  f"{_f(r['eg_vs_base_per_cpu'], '.2f', 'x')} | {_f(r['eg_added_p50_ms'], '.2f', ' ms')} | "
                  f"{_f(r['base_added_p50_ms'], '.2f', ' ms')} |" for r in base]
    bulk = bulk_summary(report.get("bulk", []))
    if bulk:
        size = max((r["bytes"] for r in report["bulk"]), default=0) / (1 << 20)
        client = next(iter(bulk.values()))["client"]
        lines += ["", f"Bulk download over HTTPS ({size:.0f} MiB, one connection, client {client}):", "",
                  "| candidate | MiB/s (median) | per run | proxy CPU s | egressgate RSS before -> peak MB "
                  f"(goal <= {GOALS['rss_mb']:.0f} on MITM) | failures |", "|---|---:|---|---:|---:|---|"]
        for cand, b in bulk.items():
            rss = (f"{b['rss_before_mb']} -> {b['peak_rss_mb']}" if b["peak_rss_mb"] is not None else "-")
            if cand == "egressgate":
                rss += _goal(b["peak_rss_mb"], GOALS["rss_mb"], higher=False)
            lines.append(f"| {BULK_LABEL[cand]} | {_f(b['mib_per_s'], '.1f')} | "
                         f"{' / '.join(f'{x:.1f}' for x in b['runs'])} | {_f(b['proxy_cpu_s'], '.1f')} | {rss} | "
                         f"{'; '.join(b['failed']) or '-'} |")
        pt, sq = bulk.get("egressgate-pt", {}).get("mib_per_s"), bulk.get("squid", {}).get("mib_per_s")
        if pt and sq:
            lines += ["", f"Passthrough / Squid bulk MiB/s: {pt / sq:.2f}x{_goal(pt / sq, GOALS['pt_vs_squid'])}."]
    if report.get("audit_records") is not None:
        lines += ["", f"egressgate had written {report['audit_records']} audit records before it was stopped "
                  "(hash-chained: the measured pipeline ran with audit on)."]
    for name, why in report.get("unavailable", {}).items():
        lines += ["", f"{name}: not available ({why})."]
    return "\n".join(lines)


def write(report: dict, md: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / ("bench-" + time.strftime("%Y%m%dT%H%MZ", time.gmtime()))
    paths = [stem.with_suffix(".md"), stem.with_suffix(".json")]
    paths[0].write_text(md + "\n")
    paths[1].write_text(json.dumps(report, indent=1, default=str) + "\n")
    png = stem.with_suffix(".png")
    why = plot(report, png)
    if why is None:
        paths.append(png)
    else:
        print(f"no plot: {why}")
    return paths


def record(md: str, results_md: Path) -> None:
    with results_md.open("a") as fh:
        fh.write("\n" + md + "\n")


def plot(report: dict, path: Path) -> str | None:
    """rps (top) and p50/p99 (middle, log scale) per candidate, one column per concurrency; bulk MiB/s below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    summary = [s for s in report["summary"] if s["rps"] is not None]
    concs = sorted({s["conc"] for s in summary})
    fig = plt.figure(figsize=(6 * max(1, len(concs)), 13), layout="constrained")
    grid = fig.add_gridspec(3, max(1, len(concs)))
    for col, conc in enumerate(concs):
        cells = [s for s in summary if s["conc"] == conc]
        labels = [f"{s['mode']}\n{LABEL[(s['candidate'], s['mode'])]}" for s in cells]
        colors = [COLOR[s["candidate"]] for s in cells]
        x = range(len(cells))
        ax = fig.add_subplot(grid[0, col])
        bars = ax.bar(x, [s["rps"] for s in cells], color=colors)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"requests/s, c={conc} (median of repeats, log scale)")
        ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
        ax = fig.add_subplot(grid[1, col])
        ax.bar([i - 0.2 for i in x], [s["p50_ms"] for s in cells], width=0.4, color=colors, label="p50")
        ax.bar([i + 0.2 for i in x], [s["p99_ms"] for s in cells], width=0.4, color=colors, alpha=0.45,
               hatch="//", label="p99")
        ax.set_yscale("log")
        ax.set_title(f"latency ms, c={conc}: p50 (solid), p99 (hatched), log scale")
        ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    bulk = bulk_summary(report.get("bulk", []))
    if bulk:
        ax = fig.add_subplot(grid[2, :])
        names = [c for c, b in bulk.items() if b["mib_per_s"] is not None]
        bars = ax.barh([BULK_LABEL[c] for c in names], [bulk[c]["mib_per_s"] for c in names],
                       color=[COLOR[c] for c in names])
        ax.bar_label(bars, fontsize=8, labels=[
            f"{bulk[c]['mib_per_s']:.0f} MiB/s" + (f", peak RSS {bulk[c]['peak_rss_mb']:.0f} MB"
                                                    if bulk[c].get("peak_rss_mb") is not None else "")
            for c in names])
        ax.margins(x=0.25)
        ax.set_title("bulk download over HTTPS, MiB/s (median); egressgate's peak RSS during it")
    m = report["meta"]
    fig.suptitle(f"make bench, {m['started']}, tree {m['git']}" + (" (NOISY RUN)" if m.get("noisy") else ""))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None
