"""`make bench`: direct, Squid, bare mitmdump and egressgate in ONE interleaved run in a closed namespace world.

    make bench [BENCH_ARGS="--quick"]          # or: .venv/bin/python -m loadtests.bench [options]

Candidates (each a separate process in the gateway namespace, all started once; loadtests/bench_world.py):
  direct          the client talks to the upstream itself (the ceiling)
  squid           Debian's Squid: forward proxy for plain HTTP, CONNECT tunnel for HTTPS (no MITM)
  squid-bump      the same Squid (squid-openssl) as an ssl-bump MITM for HTTPS, its own process and test CA:
                  the C reference for egressgate's MITM rate (reported "not available" without OpenSSL)
  mitmdump        bare mitmdump 12.3.1 (no scripts): forward proxy for plain HTTP, MITM for HTTPS
  egressgate      `egressgate run`, full pipeline (identity, policy, pinning, budgets, audit to a file):
                  plain HTTP, and HTTPS intercepted (MITM)
  egressgate-base with `--baseline TREE`: the same gateway from another source tree (e.g. `git archive` of
                  the commit before a change), for an A/B in the same interleaved run
  egressgate-pt   the same gateway, another sandbox whose rule is `tls: passthrough` (spliced, not
                  intercepted); measured only if the installed policy engine accepts such a rule,
                  reported "not available" otherwise

Cells: keep-alive GETs of a 1 KiB body (`--body-bytes`; loadtests/loadgen.py: a request counts only with
status 200 and the full body) at c=1 and c=32 for every candidate and mode, `--repeats` times,
interleaved (repeat 1 of every cell, then repeat 2 with the candidate order rotated) so drift spreads over
all candidates; figures are medians over repeats. Then a bulk download (`--bulk-bytes`, 1 GiB) over
HTTPS for direct, Squid (tunnel), egressgate MITM and passthrough, with egressgate's peak RSS during each
of its downloads; the bulk client is curl (a Python client would be the bottleneck; loadtests/streaming.py).
Trust proves the path: the client trusts only the MITM CA on intercepted cells and only the upstream's
CA on direct/tunnel/passthrough cells, so a passthrough that intercepted (or a MITM that did not) fails.

The machine's load is sampled at start and end (loadtests/bench_load.py) and printed with the table, so a
noisy run can be discarded. Output: loadtests/results/bench-<UTC>.{md,json,png}; `--record` appends the
table and the command to loadtests/RESULTS.md. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests import bench_load, bench_procs, bench_report
from loadtests.bench_world import ADDR, UPSTREAM_NAME, World
from loadtests.loadgen import Target, run_cell
from loadtests.procs import Proc, upstream_stats
from loadtests.streaming import Download, curl_download, download

CANDIDATES = ("direct", "squid", "squid-bump", "mitmdump", "egressgate", "egressgate-base", "egressgate-pt")
MODES = {"egressgate-pt": ("https",), "squid-bump": ("https",)}  # the others: http and https
INTERCEPTS = ("squid-bump", "mitmdump", "egressgate", "egressgate-base")  # the client trusts only their CA
BULK = ("direct", "squid", "egressgate", "egressgate-pt")
WORLD_ENV = "EGB_BENCH_WORLD"  # set for the driver re-run inside the client namespace
RESULT_ENV = "EGB_BENCH_RESULT"
ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Driver:
    """Runs inside the client namespace: starts upstream and proxies in theirs, runs every cell."""

    def __init__(self, args: argparse.Namespace, world: World, workdir: Path) -> None:
        self.args, self.world, self.dir = args, world, workdir
        self.procs: dict[str, Proc] = {}
        self.unavailable: dict[str, str] = {}
        self.certs = bench_procs.make_certs(workdir)

    def start(self) -> None:
        up = bench_procs.start_upstream(self.world, self.certs, self.dir)
        self.procs["upstream"] = up
        ports = (up.info["http_port"], up.info["https_port"])
        wanted = set(self.args.candidates)
        pt_why = bench_procs.passthrough_unavailable(ports[1]) if "egressgate-pt" in wanted else "not requested"
        if "egressgate-pt" in wanted and pt_why:
            self.unavailable["egressgate-pt"] = pt_why
        starters = {
            "squid": lambda: bench_procs.start_squid(self.world, self.dir),
            "squid-bump": lambda: bench_procs.start_squid_bump(self.world, self.dir, self.certs.ca_pem),
            "mitmdump": lambda: bench_procs.start_mitmdump(self.world, self.dir, self.certs.ca_pem),
            "egressgate": lambda: bench_procs.start_egressgate(self.world, self.dir, self.certs.ca_pem, *ports,
                                                               passthrough=pt_why is None),
        }
        if "egressgate-pt" in wanted:
            wanted.add("egressgate")
        if "egressgate-base" in wanted:
            starters["egressgate-base"] = lambda: bench_procs.start_egressgate_baseline(
                self.world, self.dir, self.certs.ca_pem, *ports, tree=self.args.baseline)
        for name, start in starters.items():
            if name not in wanted:
                continue
            try:
                self.procs[name] = start()
                log(f"{name} up on {ADDR['gw']}:{self.procs[name].info['port']}")
            except Exception as exc:  # one missing proxy must not hide the others' figures
                self.unavailable[name] = " ".join(str(exc).split())[:300]
                log(f"{name} UNAVAILABLE: {exc}")
        if "egressgate" in self.unavailable and "egressgate-pt" not in self.unavailable:
            self.unavailable["egressgate-pt"] = "egressgate did not start"

    def audit_records(self) -> int | None:
        """Records in egressgate's audit files (the live one and the ones it rotated out at 64 MB; a line may
        batch several records, each carries one chain hash): proof that the measured pipeline had audit on."""
        eg = self.procs.get("egressgate")
        if eg is None:
            return None
        n = 0
        for path in Path(eg.info["audit"]).parent.iterdir():
            if path.is_file():
                with path.open("rb") as fh:
                    n += sum(line.count(b'"egressgate.chain.hash"') for line in fh)
        return n

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()

    def available(self) -> list[str]:
        return [c for c in self.args.candidates if c not in self.unavailable
                and (c == "direct" or c.removesuffix("-pt") in self.procs)]

    def proc_of(self, candidate: str) -> Proc | None:
        return self.procs.get(candidate.removesuffix("-pt"))

    def target(self, candidate: str, mode: str) -> Target:
        up = self.procs["upstream"]
        common = {"scheme": mode, "host": UPSTREAM_NAME, "port": up.info[f"{mode}_port"],
                  "path": f"/bytes/{self.args.body_bytes}", "expect_body": self.args.body_bytes}
        upstream_ca = str(self.certs.ca_pem)
        if candidate == "direct":
            return Target(dial=(ADDR["up"], common["port"]), via_proxy=False, ca_file=upstream_ca, **common)
        p = self.proc_of(candidate)
        assert p is not None
        intercepts = candidate in INTERCEPTS
        auth = p.info.get("sandbox_pt" if candidate == "egressgate-pt" else "sandbox")
        return Target(dial=(ADDR["gw"], p.info["port"]), via_proxy=True,
                      ca_file=p.info["ca"] if intercepts else upstream_ca, proxy_auth=auth,
                      x509_strict=candidate != "squid-bump", **common)

    def matrix(self) -> list[dict]:
        a = self.args
        names = self.available()
        rows: list[dict] = []
        for rep in range(a.repeats):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for mode in a.modes:
                for conc in a.concurrency:
                    for name in order:
                        if mode not in MODES.get(name, ("http", "https")):
                            continue
                        rows.append(self.cell(rep, mode, conc, name))
        return rows

    def cell(self, rep: int, mode: str, conc: int, name: str) -> dict:
        a = self.args
        p = self.proc_of(name)
        cpu0 = p.cpu_seconds() if p else 0.0
        conns0 = upstream_stats(self.procs["upstream"])["connections"]
        row: dict = {"rep": rep, "mode": mode, "conc": conc, "candidate": name}
        try:
            r = run_cell(self.target(name, mode), conc, a.seconds)
        except RuntimeError as exc:
            log(f"rep {rep + 1} {mode:5} c={conc:<3} {name:13} FAILED {exc}")
            return {**row, "failed": str(exc)}
        cpu = (p.cpu_seconds() - cpu0) / a.seconds if p else None
        # connections the upstream accepted for this cell (-1: the /__stats one): ~conc when the proxy reuses
        # its upstream connections, ~requests when it opens one per request
        conns = upstream_stats(self.procs["upstream"])["connections"] - conns0 - 1
        row.update({"rps": r.rps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors, "proxy_cpu": cpu,
                    "client_cpu": r.loadgen_cpu, "upstream_conns": conns, "requests": r.ok})
        err = sum(r.errors.values())
        log(f"rep {rep + 1} {mode:5} c={conc:<3} {name:13} {r.rps:9.1f} rps  p50 {r.p50_ms:7.2f} ms  "
            f"p99 {r.p99_ms:7.2f} ms  proxy cpu {cpu or 0:.2f}  client cpu {r.loadgen_cpu:.2f}  upstream conns {conns}"
            + (f"  ERRORS {err}: {r.errors}" if err else ""))
        return row

    @property
    def client(self) -> str:
        return "curl" if shutil.which("curl") else "python"

    def fetch(self, target: Target, n: int) -> Download:
        """curl when installed (a C client: the proxy, not the client, must set the figure), else Python."""
        return curl_download(target, n) if self.client == "curl" else download(target, n)

    def bulk(self) -> list[dict]:
        a = self.args
        names = [c for c in self.available() if c in BULK]
        rows = []
        for rep in range(a.bulk_repeats):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                p = self.proc_of(name)
                gateway = p if name.startswith("egressgate") else None
                row: dict = {"rep": rep, "candidate": name}
                if gateway is not None:
                    row["rss_before_mb"] = round(gateway.status("VmRSS") / 1024, 1)
                    row["hwm_reset"] = bench_procs.reset_peak_rss(gateway)
                cpu0 = p.cpu_seconds() if p else 0.0
                d = self.fetch(self.target(name, "https"), a.bulk_bytes)
                row.update({"bytes": d.bytes, "seconds": round(d.seconds, 2), "mib_per_s": round(d.mib_per_s, 1),
                            "ok": d.ok, "error": d.error,
                            "proxy_cpu_s": round(p.cpu_seconds() - cpu0, 1) if p else None, "client": self.client})
                if gateway is not None:
                    row["peak_rss_mb"] = round(gateway.status("VmHWM") / 1024, 1)
                rows.append(row)
                log(f"bulk rep {rep + 1} {name:13} {row['mib_per_s']:7.1f} MiB/s  {row['seconds']} s"
                    + (f"  peak RSS {row['peak_rss_mb']} MB" if gateway is not None else "")
                    + ("" if d.ok else f"  FAILED {d.error}"))
        return rows


def summarize(rows: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["mode"], r["conc"], r["candidate"]), []).append(r)
    out = []
    for (mode, conc, cand), rs in cells.items():
        ok = [x for x in rs if "rps" in x]
        cpus = [x["proxy_cpu"] for x in ok if x["proxy_cpu"] is not None]
        out.append({
            "mode": mode, "conc": conc, "candidate": cand, "runs": [round(x["rps"], 1) for x in ok],
            "rps": statistics.median(x["rps"] for x in ok) if ok else None,
            "p50_ms": statistics.median(x["p50_ms"] for x in ok) if ok else None,
            "p99_ms": statistics.median(x["p99_ms"] for x in ok) if ok else None,
            "proxy_cpu": statistics.median(cpus) if cpus else None,
            # requests per proxy CPU-second: less sensitive to CPU other work takes on a shared machine
            "req_per_cpu_s": statistics.median(x["rps"] / x["proxy_cpu"] for x in ok)
            if ok and all(x["proxy_cpu"] for x in ok) else None,
            "upstream_conns": statistics.median(conns) if (conns := [x["upstream_conns"] for x in ok
                                                                    if "upstream_conns" in x]) else None,
            "errors": sum(sum(x["errors"].values()) for x in ok) + sum(1 for x in rs if "failed" in x),
        })
    order = {c: i for i, c in enumerate(CANDIDATES)}
    out.sort(key=lambda s: (s["mode"], s["conc"], order[s["candidate"]]))
    return out


def inner(args: argparse.Namespace) -> None:
    world = World(os.environ[WORLD_ENV])
    workdir = Path(tempfile.mkdtemp(prefix="egB-bench-"))
    driver = Driver(args, world, workdir)
    result: dict = {}
    try:
        driver.start()
        result["unavailable"] = driver.unavailable
        result["commands"] = {k: p.info["cmd"] for k, p in driver.procs.items() if p.info.get("cmd")}
        rows = driver.matrix()
        result.update({"rows": rows, "summary": summarize(rows)})
        result["bulk"] = driver.bulk() if args.bulk_bytes > 0 and args.bulk_repeats > 0 else []
        result["audit_records"] = driver.audit_records()
    finally:
        driver.stop()
        Path(os.environ[RESULT_ENV]).write_text(json.dumps(result, indent=1, default=str))
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def outer(args: argparse.Namespace, argv: list[str]) -> int:
    if os.geteuid() != 0:
        print("make bench needs root (it creates network namespaces)", file=sys.stderr)
        return 2
    command = shlex.join([".venv/bin/python", "-m", "loadtests.bench", *argv])
    meta = {"command": command, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "git": bench_report.git_state(ROOT), "mitmproxy": bench_report.version("mitmproxy"),
            "squid": bench_report.squid_version(), "python": sys.version.split()[0]}
    meta["load_start"] = bench_load.idle_sample()
    log(bench_load.describe("load at start", meta["load_start"]))
    meter = bench_load.RunMeter()
    meter.start()
    world = World.create()
    meta["world"] = world.tag
    log(f"world {world.tag}: client {ADDR['cli']}, proxies {ADDR['gw']}, upstream {ADDR['up']} ({UPSTREAM_NAME})")
    result_file = Path(tempfile.mkstemp(prefix="egB-bench-result-")[1])
    try:
        env = {**os.environ, WORLD_ENV: world.tag, RESULT_ENV: str(result_file)}
        rc = subprocess.run([*world.exec_prefix("cli"), sys.executable, "-m", "loadtests.bench", *argv], env=env,
                            cwd=ROOT, timeout=args.timeout).returncode
        result = json.loads(result_file.read_text() or "{}")
    finally:
        world.destroy()
        result_file.unlink(missing_ok=True)
    meta["load_run"] = meter.read()
    meta["load_end"] = bench_load.idle_sample()
    log(bench_load.describe("load at end", meta["load_end"]))
    log(bench_load.describe_run(meta["load_run"]))
    if not result.get("summary"):
        print(f"bench failed (driver exit code {rc}); see the log above", file=sys.stderr)
        return rc or 1
    meta["noisy"] = bench_load.noisy(meta["load_start"], meta["load_end"], meta["load_run"])
    report = {"meta": meta, **result}
    md = bench_report.markdown(report)
    print(md)
    paths = bench_report.write(report, md, args.out_dir)
    for p in paths:
        log(f"wrote {p}")
    if args.record:
        bench_report.record(md, ROOT / "loadtests" / "RESULTS.md")
        log("appended the table to loadtests/RESULTS.md")
    return rc


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured window per cell")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--body-bytes", type=int, default=1024, help="response body of each GET in the rps cells")
    ap.add_argument("--modes", nargs="+", default=["http", "https"], choices=["http", "https"])
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    ap.add_argument("--bulk-bytes", type=int, default=1 << 30, help="bulk download size (0: no bulk)")
    ap.add_argument("--bulk-repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (~1 min): 2 s cells, 1 repeat, 128 MiB bulk (explicit options still win)")
    ap.add_argument("--record", action="store_true", help="append the table and the command to RESULTS.md")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "loadtests" / "results")
    ap.add_argument("--timeout", type=float, default=3600, help="stop the whole run after this many seconds")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, audit file)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a source tree (its egressgate/ package) run as the extra candidate egressgate-base")
    if "--quick" in argv:
        ap.set_defaults(seconds=2.0, repeats=1, bulk_bytes=128 << 20)
    args = ap.parse_args(argv)
    if args.baseline is not None and "egressgate-base" not in args.candidates:
        args.candidates.append("egressgate-base")
    if args.baseline is None and "egressgate-base" in args.candidates:
        args.candidates.remove("egressgate-base")  # nothing to compare with
    return args


def main() -> None:
    argv = sys.argv[1:]
    args = parse(argv)
    if os.environ.get(WORLD_ENV):
        inner(args)
        return
    sys.exit(outer(args, argv))


if __name__ == "__main__":
    main()
