"""Gateway throughput and latency vs direct, bare mitmdump and Squid, in one run (issue 3, "Benchmark").

    .venv/bin/python -m loadtests.gateway_bench [--seconds 10] [--repeats 3] [--markdown FILE] [--json FILE]

One run, one machine: an upstream (loadtests/upstream.py), bare `mitmdump`, `egressgate run` (full
pipeline: identity, policy, pinning, budgets, audit to a file) and Squid start once; then every cell
(mode x concurrency x target) runs `--repeats` times, interleaved (repeat 1 of every cell, then repeat 2,
with the target order rotated), so slow drift from other load on the machine spreads over all targets.
Figures are medians over the repeats; ratios are median rps / median bare-mitmdump rps of the same mode
and concurrency. Each cell: keep-alive clients (loadtests/loadgen.py), warmed up, for `--seconds`.

Modes: `http` = plain HTTP through the proxy (absolute-form); `https` = CONNECT + TLS, intercepted by
mitmdump and egressgate (MITM with their CA), but only tunnelled by Squid (no MITM: a different, cheaper
job — labelled as such). `direct` = the client talks to the upstream itself (reference ceiling).
Extras: a 1 GiB download through a fresh egressgate (peak RSS from /proc VmHWM), time to first SSE event,
and a py-spy profile of egressgate and mitmdump (separate runs; never part of the measured cells).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests import bench_report, procs
from loadtests.loadgen import Target, run_cell
from loadtests.profile import profile_during
from loadtests.streaming import download, sse_first_event
from loadtests.upstream import SMALL_BODY

TARGETS = ("direct", "mitmdump", "egressgate", "egressgate-base", "egressgate-cred", "egressgate-noaudit", "squid")
# Pseudo-targets: another sandbox on a running proxy (HTTPS only: credentials are injected only there).
SANDBOX_OF = {"egressgate-cred": ("egressgate", "sandbox_cred")}
LABEL = {
    ("squid", "http"): "squid (forward)",
    ("squid", "https"): "squid (CONNECT tunnel, no MITM)",
    ("mitmdump", "https"): "mitmdump (MITM)",
    ("egressgate", "https"): "egressgate (MITM)",
    ("egressgate-cred", "https"): "egressgate (MITM) + injected credential",
    ("egressgate-noaudit", "http"): "egressgate, audit discarded (bench only)",
    ("egressgate-noaudit", "https"): "egressgate (MITM), audit discarded (bench only)",
    ("egressgate-base", "http"): "egressgate, baseline tree (--baseline)",
    ("egressgate-base", "https"): "egressgate (MITM), baseline tree (--baseline)",
}


@contextlib.contextmanager
def _pythonpath(tree: Path | None):
    """Start a process (and its `sandbox admit` calls) with another source tree first on the path: the
    before/after comparison runs both trees in one interleaved run instead of two runs minutes apart."""
    if tree is None:
        yield
        return
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree)
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.dir = workdir
        self.procs: dict[str, procs.Proc] = {}
        self.unavailable: dict[str, str] = {}
        self.certs = procs.make_certs(workdir)

    def start(self, targets: list[str]) -> None:
        if self.args.upstream_host == procs.UPSTREAM_NAME:
            procs.check_loopback_name()
        up = procs.start_upstream(self.certs, self.dir)
        self.procs["upstream"] = up
        starters = {
            "mitmdump": lambda: procs.start_mitmdump(self.dir, self.certs.ca_pem, self.args.mitmdump_flow_detail),
            "squid": lambda: procs.start_squid(self.dir),
            "egressgate": lambda: procs.start_egressgate(self.dir, self.certs.ca_pem, up.info["http_port"],
                                                         up.info["https_port"], upstream_host=self.args.upstream_host),
            "egressgate-noaudit": lambda: procs.start_egressgate(
                self.dir, self.certs.ca_pem, up.info["http_port"], up.info["https_port"],
                upstream_host=self.args.upstream_host, audit=False, name="egressgate-noaudit"),
            "egressgate-base": lambda: self._baseline(up),
        }
        for name in targets:
            if name in starters:
                try:
                    self.procs[name] = starters[name]()
                    log(f"{name} up: {self.procs[name].info.get('port')}")
                except Exception as exc:  # one missing proxy must not hide the others' figures
                    self.unavailable[name] = str(exc).splitlines()[0][:300]
                    log(f"{name} UNAVAILABLE: {exc}")

    def _baseline(self, up: procs.Proc) -> procs.Proc:
        if self.args.baseline is None:
            raise RuntimeError("no --baseline tree given")
        with _pythonpath(self.args.baseline):
            return procs.start_egressgate(self.dir, self.certs.ca_pem, up.info["http_port"], up.info["https_port"],
                                          upstream_host=self.args.upstream_host, name="egressgate-base")

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()

    def target(self, name: str, scheme: str, path: str = "/", proxy: procs.Proc | None = None) -> Target:
        up = self.procs["upstream"]
        port = up.info[f"{scheme}_port"]
        common = {"scheme": scheme, "host": self.args.upstream_host, "port": port, "path": path,
                  "expect_body": len(SMALL_BODY) if path == "/" else None}
        if name == "direct":
            return Target(dial=("127.0.0.1", port), via_proxy=False, ca_file=str(self.certs.ca_pem), **common)
        proc_name, sandbox_key = SANDBOX_OF.get(name, (name, "sandbox"))
        p = proxy or self.procs[proc_name]
        mitm = name.startswith(("mitmdump", "egressgate"))
        return Target(dial=("127.0.0.1", p.info["port"]), via_proxy=True,
                      ca_file=p.info["ca"] if mitm else str(self.certs.ca_pem),
                      proxy_auth=p.info.get(sandbox_key), **common)

    def upstream_capacity(self) -> dict:
        """wrk straight at the upstream: shows it is not the bottleneck (wrk itself is C, multi-threaded)."""
        wrk = shutil.which("wrk")
        if not wrk:
            return {"error": "wrk not installed"}
        out = {}
        for scheme in ("http", "https"):
            port = self.procs["upstream"].info[f"{scheme}_port"]
            cmd = [wrk, "-t2", "-c32", "-d3s", f"{scheme}://127.0.0.1:{port}/"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            rps = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("Requests/sec")]
            out[scheme] = {"rps": float(rps[0]) if rps else None, "cmd": " ".join(cmd)}
        return out

    def matrix(self) -> list[dict]:
        a = self.args
        names = [t for t in a.targets if t == "direct" or SANDBOX_OF.get(t, (t,))[0] in self.procs]
        rows = []
        for rep in range(a.repeats):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for mode in a.modes:
                for conc in a.concurrency:
                    for name in order:
                        if name in SANDBOX_OF and mode == "http":
                            continue
                        p = self.procs.get(SANDBOX_OF.get(name, (name,))[0])
                        cpu0 = p.cpu_seconds() if p else 0.0
                        stats0 = procs.upstream_stats(self.procs["upstream"])
                        try:
                            r = run_cell(self.target(name, mode), conc, a.seconds, procs=a.procs)
                        except RuntimeError as exc:
                            log(f"rep {rep + 1} {mode} c={conc} {name}: FAILED {exc}")
                            rows.append({"rep": rep, "mode": mode, "conc": conc, "target": name, "failed": str(exc)})
                            continue
                        cpu = (p.cpu_seconds() - cpu0) / a.seconds if p else None
                        stats1 = procs.upstream_stats(self.procs["upstream"])
                        injected = stats1["bearer_seen"] - stats0["bearer_seen"]
                        # -1 for the /__stats connection itself; keep-alive proxies open ~conc of them
                        upstream_conns = stats1["connections"] - stats0["connections"] - 1
                        # the credentialed sandbox's requests all carry it upstream; nobody else's ever does
                        if injected < r.ok if name == "egressgate-cred" else injected > 0:
                            r.errors[f"credential seen upstream in {injected} of {r.ok} requests"] = 1
                        rows.append({"rep": rep, "mode": mode, "conc": conc, "target": name, "rps": r.rps,
                                     "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors,
                                     "proxy_cpu": cpu, "loadgen_cpu": r.loadgen_cpu,
                                     "upstream_connections": upstream_conns})
                        err = sum(r.errors.values())
                        log(f"rep {rep + 1} {mode:5} c={conc:<3} {name:10} {r.rps:9.1f} rps  p50 {r.p50_ms:7.2f} ms"
                            f"  p99 {r.p99_ms:7.2f} ms  proxy cpu {cpu if cpu is not None else 0:.2f}"
                            f"  client cpu {r.loadgen_cpu:.2f}  upstream conns {upstream_conns}"
                            + (f"  ERRORS {err}: {r.errors}" if err else ""))
        return rows

    def streaming(self) -> dict:
        """1 GiB through a fresh egressgate (its VmHWM is the download's peak), SSE first event."""
        a = self.args
        up = self.procs["upstream"]
        out: dict = {}
        try:
            eg = procs.start_egressgate(self.dir, self.certs.ca_pem, up.info["http_port"], up.info["https_port"],
                                        name="egressgate-stream", upstream_host=self.args.upstream_host)
        except Exception as exc:
            return {"error": f"egressgate unavailable: {str(exc)[:300]}"}
        self.procs["egressgate-stream"] = eg
        try:
            base = {"rss_kb": eg.status("VmRSS"), "hwm_kb": eg.status("VmHWM")}
            for scheme in a.stream_modes:
                d = download(self.target("egressgate", scheme, "/", proxy=eg), a.stream_bytes)
                out[f"download_{scheme}"] = {"bytes": d.bytes, "seconds": round(d.seconds, 2),
                                             "mib_per_s": round(d.mib_per_s, 1), "ok": d.ok, "error": d.error,
                                             "gateway_vmhwm_mb": round(eg.status("VmHWM") / 1024, 1)}
                log(f"download {scheme} via egressgate: {out[f'download_{scheme}']}")
            out["gateway_baseline_mb"] = {k: round(v / 1024, 1) for k, v in base.items()}
            d = download(self.target("direct", "https"), a.stream_bytes)
            out["download_direct_https"] = {"seconds": round(d.seconds, 2), "mib_per_s": round(d.mib_per_s, 1),
                                            "ok": d.ok, "error": d.error}
            sse = {"direct": sse_first_event(self.target("direct", "https"))}
            sse["egressgate (MITM)"] = sse_first_event(self.target("egressgate", "https", proxy=eg))
            if "mitmdump" in self.procs:
                sse["mitmdump (MITM, default: buffers)"] = sse_first_event(self.target("mitmdump", "https"))
            out["sse"] = sse
            log(f"sse: {sse}")
        finally:
            eg.stop()
        return out

    def profiles(self) -> dict:
        out = {}
        for name in ("egressgate", "mitmdump"):
            p = self.procs.get(name)
            if p is None:
                continue
            for mode in self.args.modes:
                raw = self.dir / f"profile-{name}-{mode}.txt"
                t = self.target(name, mode)
                conc = self.args.profile_concurrency
                out[f"{name} {mode} c={conc}"] = profile_during(
                    p.pid, self.args.profile_seconds, raw,
                    lambda t=t, conc=conc: run_cell(t, conc, self.args.profile_seconds - 1, procs=self.args.procs))
                log(f"profile {name} {mode}: {json.dumps(out[f'{name} {mode} c={conc}'])[:600]}")
        return out


def summarize(rows: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if "rps" in r:
            cells.setdefault((r["mode"], r["conc"], r["target"]), []).append(r)
    summary = []
    for (mode, conc, target), rs in cells.items():
        base = cells.get((mode, conc, "mitmdump"))
        med = statistics.median(x["rps"] for x in rs)
        base_med = statistics.median(x["rps"] for x in base) if base else None
        cpus = [x["proxy_cpu"] for x in rs if x["proxy_cpu"] is not None]
        summary.append({
            "mode": mode, "conc": conc, "target": target, "label": LABEL.get((target, mode), target),
            "rps": med, "rps_runs": [round(x["rps"], 1) for x in rs],
            "p50_ms": statistics.median(x["p50_ms"] for x in rs), "p99_ms": statistics.median(x["p99_ms"] for x in rs),
            "ratio_vs_mitmdump": med / base_med if base_med else None,
            "errors": sum(sum(x["errors"].values()) for x in rs),
            "proxy_cpu": statistics.median(cpus) if cpus else None,
            # requests per proxy CPU-second: robust to CPU stolen by other work on a shared machine
            "req_per_cpu_s": statistics.median(x["rps"] / x["proxy_cpu"] for x in rs if x["proxy_cpu"])
            if cpus and all(cpus) else None,
            "client_cpu": statistics.median(x["loadgen_cpu"] for x in rs),
        })
    order = {t: i for i, t in enumerate(TARGETS)}
    summary.sort(key=lambda s: (s["mode"], s["conc"], order.get(s["target"], 9)))
    return summary


def markdown(summary: list[dict], meta: dict) -> str:
    lines = ["| mode | conc | target | rps (median) | rps per run | p50 ms | p99 ms | vs mitmdump | proxy CPU "
             "| req/CPU-s | client CPU | errors |", "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        ratio = f"{s['ratio_vs_mitmdump']:.2f}x" if s["ratio_vs_mitmdump"] is not None else "-"
        cpu = f"{s['proxy_cpu']:.2f}" if s["proxy_cpu"] is not None else "-"
        per_cpu = f"{s['req_per_cpu_s']:.0f}" if s["req_per_cpu_s"] else "-"
        lines.append(f"| {s['mode']} | {s['conc']} | {s['label']} | {s['rps']:.0f} | "
                     f"{' / '.join(f'{x:.0f}' for x in s['rps_runs'])} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
                     f"{ratio} | {cpu} | {per_cpu} | {s['client_cpu']:.2f} | {s['errors']} |")
    lines += ["", "| mode | conc | egressgate / bare mitmdump rps (goal >= 1.0x, < 0.85x defect) "
              "| same, per proxy CPU-second | audit on / off rps (goal >= 0.9x) | same, per CPU-second "
              "| credential / none rps (goal >= 0.9x) | same, per CPU-second "
              "| this tree / baseline rps | same, per CPU-second | baseline / mitmdump rps |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(a: dict | None, b: dict | None, key: str) -> str:
        return f"{a[key] / b[key]:.2f}x" if a and b and a.get(key) and b.get(key) else "-"

    by = {(s["mode"], s["conc"], s["target"]): s for s in summary}
    for mode, conc in sorted({(s["mode"], s["conc"]) for s in summary}):
        eg, md, off, cred, base = (by.get((mode, conc, t)) for t in (
            "egressgate", "mitmdump", "egressgate-noaudit", "egressgate-cred", "egressgate-base"))
        lines.append(f"| {mode} | {conc} | {ratio(eg, md, 'rps')} | {ratio(eg, md, 'req_per_cpu_s')} "
                     f"| {ratio(eg, off, 'rps')} | {ratio(eg, off, 'req_per_cpu_s')} "
                     f"| {ratio(cred, eg, 'rps')} | {ratio(cred, eg, 'req_per_cpu_s')} "
                     f"| {ratio(eg, base, 'rps')} | {ratio(eg, base, 'req_per_cpu_s')} "
                     f"| {ratio(base, md, 'rps')} |")
    for name, why in meta.get("unavailable", {}).items():
        lines.append(f"\n{name}: not measured ({why})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per cell")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--modes", nargs="+", default=["http", "https"], choices=["http", "https"])
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    ap.add_argument("--procs", type=int, default=None, help="client processes per cell (default: 1 at c=1, else 2)")
    ap.add_argument("--upstream-host", default=procs.UPSTREAM_NAME, choices=[procs.UPSTREAM_NAME, "127.0.0.1"],
                    help="how requests name the upstream: a name the proxies resolve, or the IP literal")
    ap.add_argument("--mitmdump-flow-detail", type=int, default=0)
    ap.add_argument("--stream-bytes", type=int, default=1 << 30)
    ap.add_argument("--stream-modes", nargs="*", default=["https", "http"], choices=["http", "https"])
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--profile-seconds", type=float, default=8, help="py-spy profile runs after the matrix (0: none)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a source tree (e.g. `git archive main egressgate | tar -x -C DIR`) run as target "
                         "egressgate-base, interleaved with the working tree's egressgate")
    ap.add_argument("--profile-concurrency", type=int, default=32)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, audit file, profiles)")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="egressgate-gwbench-"))
    bench = Bench(args, workdir)
    meta: dict = {"command": shlex.join([Path(sys.executable).name, "-m", "loadtests.gateway_bench", *sys.argv[1:]]),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
                  "cpus": __import__("os").cpu_count(), "workdir": str(workdir),
                  "git": bench_report.git_state(procs.ROOT)}
    try:
        bench.start(args.targets)
        meta["unavailable"] = bench.unavailable
        meta["commands"] = {k: p.info.get("cmd") for k, p in bench.procs.items() if p.info.get("cmd")}
        meta["upstream_capacity_wrk"] = bench.upstream_capacity()
        log(f"upstream capacity (wrk): {meta['upstream_capacity_wrk']}")
        rows = bench.matrix()
        summary = summarize(rows)
        extras = {} if args.no_stream else bench.streaming()
        prof = bench.profiles() if args.profile_seconds else {}
        meta["load1"] = Path("/proc/loadavg").read_text().split()[:3]
    finally:
        bench.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    md = markdown(summary, meta)
    print(md)
    print(json.dumps({"streaming": extras, "profiles": prof}, indent=1))
    if args.markdown:
        args.markdown.write_text(md + "\n")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary, "streaming": extras,
                                         "profiles": prof}, indent=1, default=str))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
