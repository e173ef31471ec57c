"""`make bench-state`: issue 12's performance goals, in the closed namespace world of `make bench`.

    make bench-state [BENCH_ARGS="--quick"]     # or: .venv/bin/python -m loadtests.state_bench [options]

Candidates (all `egressgate run`, full pipeline with audit to a file, each started once in the gateway
namespace, each with its own sandbox; loadtests/state_procs.py):
  memory      state backend memory, one process (the embedded default)
  redis       state backend Redis (loopback in the gateway namespace, appendonly), one process
  redis-2w    the same with `--workers 2` (Redis is required for more than one worker)
  redis-setsid  (diagnostic, only if named) `redis` in its own session, as each worker is: a session is its
              own scheduler autogroup, which alone costs on a busy host (loadtests/state_procs.py)

Cells: keep-alive GETs of a 1 KiB body at c=1 and c=32, plain HTTP and HTTPS (MITM), `--repeats` times,
interleaved (every candidate once per repeat, order rotated) so drift spreads over all; figures are medians
over repeats. Plain-HTTP cells are driven by wrk (a C client, loadtests/wrk_proxy.py) so the gateway, not the
client, is the limit; HTTPS cells by loadtests/loadgen.py (CONNECT + TLS). Per cell: gateway CPU from /proc
for the whole process tree (supervisor + workers), requests per gateway CPU-second, the client's and Redis's
CPU, and Redis commands per request (INFO commandstats: the round trips the backend costs per request).

Goals (issue 12): (a) redis rps >= 0.9x memory rps (one worker); (b) redis-2w rps >= 1.6x redis rps at
c=32 (the machine has 2 cores shared with the client and the upstream: the per-CPU-second figure says
whether a second worker scales when cores are available); (c) p99 of the budget check (`reserve_out`, a Lua
script) <= 1 ms on loopback Redis, measured by loadtests/budget_check_bench.py in the gateway namespace:
sequentially, 32 concurrent callers, and paced while the redis gateway serves a c=32 HTTPS cell; plus
Redis's own server-side latency percentiles of the script (INFO latencystats) during the gateway cells.

Machine load is sampled at start and end and during the run (loadtests/bench_load.py) and printed with the
table. Output: loadtests/results/bench-state-<UTC>.{md,json}; `--record` appends the table and the exact
command to loadtests/RESULTS.md. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loadtests import bench_load, bench_procs, bench_report, cprofile_gateway, state_procs, state_report, wrk_proxy
from loadtests.bench_world import ADDR, UPSTREAM_NAME, World
from loadtests.loadgen import Target
from loadtests.loadgen import run_cell as loadgen_cell
from loadtests.procs import Proc, upstream_stats

WORLD_ENV = "EGB_STATE_WORLD"
RESULT_ENV = "EGB_STATE_RESULT"
ROOT = Path(__file__).resolve().parent.parent
NAMES = tuple(state_procs.CANDIDATES)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Driver:
    """Runs inside the client namespace; upstream, Redis and gateways run in theirs."""

    def __init__(self, args: argparse.Namespace, world: World, workdir: Path) -> None:
        self.args, self.world, self.dir = args, world, workdir
        self.gw_prefix = world.exec_prefix("gw")
        self.procs: dict[str, Proc] = {}
        self.unavailable: dict[str, str] = {}
        self.certs = bench_procs.make_certs(workdir)
        self.tag = secrets.token_hex(3)
        self.wrk_why = wrk_proxy.available() if args.http_client == "wrk" else "--http-client python"

    def start(self) -> None:
        up = bench_procs.start_upstream(self.world, self.certs, self.dir)
        self.procs["upstream"] = up
        redis_url = None
        if any(state_procs.CANDIDATES[c].backend == "redis" for c in self.args.candidates):
            try:
                r = state_procs.start_redis(self.dir, state_procs.REDIS_PORT, prefix=self.gw_prefix)
                self.procs["redis-server"] = r
                redis_url = r.info["url"]
                log(f"redis-server {r.info['version']} on 127.0.0.1:{r.info['port']} (gateway namespace)")
            except Exception as exc:
                log(f"redis-server UNAVAILABLE: {exc}")
        # the candidates start at once (each is CPU-bound Python start-up; nothing is measured before all are up);
        # a candidate named by --profile starts with the profiling hook, off until profiles() switches it on
        started = self._start_gateways(self.args.candidates, redis_url, self.profile_dirs(self.args.candidates),
                                       in_place=True)
        for name in self.args.candidates:
            p = started[name]
            if isinstance(p, Exception):  # one missing backend must not hide the others' figures
                self.unavailable[name] = " ".join(str(p).split())[:400]
                log(f"{name} UNAVAILABLE: {self.unavailable[name][:300]}")
            else:
                self.procs[name] = p
                log(f"{name} up on {ADDR['gw']}:{p.info['port']} (pids {p.info['pids_at_start']})")

    def profile_dirs(self, names: list[str]) -> dict[str, Path]:
        """Where the cProfile stats of each candidate in `names` that --profile names go."""
        return {name: self.dir / f"profile-{name}" for name in names if name in self.args.profile}

    def _start_gateways(self, names: list[str], redis_url: str | None, profile_dirs: dict[str, Path] | None = None,
                        in_place: bool = False) -> dict[str, Proc | Exception]:
        """state_procs.start_gateway for every name, concurrently (threads): each gateway's Proc, or why not."""
        up = self.procs["upstream"]

        def one(name: str) -> Proc | Exception:
            try:
                return state_procs.start_gateway(self.world, self.dir, self.certs.ca_pem, up.info["http_port"],
                                                 up.info["https_port"], state_procs.CANDIDATES[name], redis_url,
                                                 self.tag, profile_dir=(profile_dirs or {}).get(name),
                                                 in_place=in_place)
            except Exception as exc:
                return exc

        with ThreadPoolExecutor(max(1, len(names))) as pool:
            return dict(zip(names, pool.map(one, names), strict=True))

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()

    def available(self) -> list[str]:
        return [c for c in self.args.candidates if c in self.procs]

    def target(self, name: str, mode: str) -> Target:
        up, p = self.procs["upstream"], self.procs[name]
        return Target(scheme=mode, host=UPSTREAM_NAME, port=up.info[f"{mode}_port"], dial=(ADDR["gw"], p.info["port"]),
                      via_proxy=True, ca_file=p.info["ca"] if mode == "https" else None,
                      proxy_auth=p.info["sandbox"], path=f"/bytes/{self.args.body_bytes}",
                      expect_body=self.args.body_bytes)

    @property
    def redis(self) -> Proc | None:
        return self.procs.get("redis-server")

    def run_load(self, name: str, mode: str, conc: int):
        if mode == "http" and self.wrk_why is None:
            return wrk_proxy.run_cell(self.target(name, mode), conc, self.args.seconds), "wrk"
        return loadgen_cell(self.target(name, mode), conc, self.args.seconds), "python"

    def matrix(self) -> list[dict]:
        names = self.available()
        rows: list[dict] = []
        for rep in range(self.args.repeats):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for mode in self.args.modes:
                for conc in self.args.concurrency:
                    for name in order:
                        rows.append(self.cell(rep, mode, conc, name))
        return rows

    def cell(self, rep: int, mode: str, conc: int, name: str) -> dict:
        p = self.procs[name]
        uses_redis = state_procs.CANDIDATES[name].backend == "redis" and self.redis is not None
        row: dict = {"rep": rep, "mode": mode, "conc": conc, "candidate": name}
        if uses_redis:
            state_procs.redis_reset(self.gw_prefix, state_procs.REDIS_PORT)
            rcpu0 = state_procs.redis_cpu(self.gw_prefix, state_procs.REDIS_PORT)
        if uses_redis:
            reads0 = state_procs.redis_reads(self.gw_prefix, state_procs.REDIS_PORT)
        req0 = upstream_stats(self.procs["upstream"])["requests"]
        cpu0 = state_procs.tree_cpu_seconds(p.pid)
        by_pid0 = state_procs.tree_cpu_by_pid(p.pid)
        try:
            r, client = self.run_load(name, mode, conc)
        except RuntimeError as exc:
            log(f"rep {rep + 1} {mode:5} c={conc:<3} {name:9} FAILED {exc}")
            return {**row, "failed": str(exc)}
        cpu_s = state_procs.tree_cpu_seconds(p.pid) - cpu0
        by_pid = state_procs.tree_cpu_by_pid(p.pid)
        # cores per process of the tree (supervisor and workers), busiest first: did the load spread?
        split = sorted(((by_pid[k] - by_pid0.get(k, 0.0)) / r.seconds for k in by_pid), reverse=True)
        upstream_reqs = upstream_stats(self.procs["upstream"])["requests"] - req0 - 1  # -1: the /__stats GET
        row.update({"rps": r.rps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors, "requests": r.ok,
                    "gateway_cores": cpu_s / r.seconds, "gateway_cpu_s": cpu_s, "client": client,
                    "client_cores": r.loadgen_cpu, "upstream_requests": upstream_reqs,
                    "gateway_pids": len(by_pid), "cores_by_process": [round(x, 2) for x in split]})
        if uses_redis:
            # read events Redis processed (one per request a client sends, a pipeline or MULTI..EXEC being
            # one) less our own INFO: the round trips the gateway made, whatever ran inside scripts
            reads = state_procs.redis_reads(self.gw_prefix, state_procs.REDIS_PORT) - reads0 - 1
            row["redis_round_trips_per_req"] = reads / max(1, upstream_reqs)
            row["redis_cores"] = (state_procs.redis_cpu(self.gw_prefix, state_procs.REDIS_PORT) - rcpu0) / r.seconds
            st = state_procs.redis_stats(self.gw_prefix, state_procs.REDIS_PORT)
            row["redis_commands"] = {k: v["calls"] for k, v in st["commands"].items()
                                     if k not in ("config", "info")}
            row["redis_latency_usec"] = st["latency_usec"]
        err = sum(r.errors.values())
        log(f"rep {rep + 1} {mode:5} c={conc:<3} {name:9} {r.rps:8.1f} rps  p50 {r.p50_ms:7.2f} ms  p99 "
            f"{r.p99_ms:7.2f} ms  gateway {row['gateway_cores']:.2f} cores {row['cores_by_process']}  "
            f"{r.ok / cpu_s if cpu_s else 0:.0f} "
            f"req/CPU-s  client {r.loadgen_cpu:.2f} ({client})" + (f"  ERRORS {err}: {r.errors}" if err else ""))
        return row

    def budget_probe(self, extra: list[str], backend: str = "redis") -> dict:
        """loadtests/budget_check_bench.py in the gateway namespace (where Redis listens on loopback)."""
        cmd = [*self.gw_prefix, sys.executable, "-m", "loadtests.budget_check_bench", "--json", "--backend", backend,
               "--key-prefix", f"egB-{self.tag}-budget:", *extra]
        if backend == "redis":
            assert self.redis is not None
            cmd += ["--url", self.redis.info["url"]]
        return self._probe_result(subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600))

    @staticmethod
    def _probe_result(done: subprocess.CompletedProcess) -> dict:
        line = (done.stdout.strip().splitlines() or [""])[-1]
        try:
            return json.loads(line)
        except ValueError:
            return {"error": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"}

    def budget(self) -> list[dict]:
        a = self.args
        out = [{"case": "memory, sequential", **self.budget_probe(["-n", str(a.budget_n)], backend="memory")}]
        if self.redis is None:
            return [*out, {"case": "redis", "error": "no redis-server"}]
        out.append({"case": "redis, sequential", **self.budget_probe(["-n", str(a.budget_n)])})
        out.append({"case": "redis, 32 concurrent callers",
                    **self.budget_probe(["-n", str(a.budget_n), "--concurrency", "32"])})
        if "redis" in self.procs and "https" in a.modes:
            # paced probe while the redis gateway serves a c=32 HTTPS cell (the probe itself is light)
            cmd = [*self.gw_prefix, sys.executable, "-m", "loadtests.budget_check_bench", "--json", "--url",
                   self.redis.info["url"], "--key-prefix", f"egB-{self.tag}-budget:", "--duration",
                   str(a.seconds), "--pace-ms", "2"]
            probe = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            try:
                time.sleep(0.5)  # its warm-up
                r = loadgen_cell(self.target("redis", "https"), 32, a.seconds)
                so, se = probe.communicate(timeout=a.seconds + 120)
            finally:
                if probe.poll() is None:
                    probe.kill()
                    probe.wait()
            res = self._probe_result(subprocess.CompletedProcess(cmd, probe.returncode, so, se))
            out.append({"case": f"redis, paced 2 ms, during a c=32 HTTPS cell on `redis` ({r.rps:.0f} rps)", **res})
        return out


    def profiles(self, names: list[str]) -> dict[str, dict]:
        """Each candidate in `names` (every process of its gateway, workers too) under cProfile through a c=32
        cell per mode; where its CPU goes (loadtests/cprofile_gateway.py). Not a measured figure. A measured
        candidate is profiled in place, after every measured cell (it started with the hook, off until now:
        no second start-up of the same gateway); one not measured (--profile X without X in --candidates, or
        its measured gateway did not start) gets another gateway, started here. Then it is stopped (every
        process writes its stats on the way out)."""
        dirs = {name: self.dir / f"profile-{name}" for name in names}
        measured = {name: self.procs[name] for name in names if name in self.procs}
        others = [name for name in names if name not in measured]
        started: dict[str, Proc | Exception] = dict(measured)
        if others:
            started |= self._start_gateways(others, self.redis.info["url"] if self.redis else None, dirs)
        out = {}
        try:
            for name in names:
                p = started[name]
                if isinstance(p, Exception):
                    out[name] = {"error": " ".join(str(p).split())[:300]}
                else:
                    out[name] = {"in_place": name in measured, **self.profile(name, p, dirs[name])}
        finally:
            for p in started.values():
                if not isinstance(p, Exception):
                    p.stop()
        return out

    def profile(self, name: str, p: Proc, pdir: Path) -> dict:
        """Profile the started gateway `p` of candidate `name` (its stats go to `pdir`), then stop it."""
        out: dict = {"cells": [], "requests": 0}
        try:
            self.procs[f"{name}-profiled"] = p
            for mode in self.args.modes:
                conc = self.args.profile_concurrency
                self.run_load(f"{name}-profiled", mode, conc)  # warm (connections, certificates, caches)
                pids = state_procs.tree_pids(p.pid)
                for pid in pids:
                    os.kill(pid, signal.SIGUSR1)
                r, client = self.run_load(f"{name}-profiled", mode, conc)
                for pid in pids:
                    os.kill(pid, signal.SIGUSR2)
                out["requests"] += r.ok
                out["cells"].append(f"{mode} c={conc} {r.rps:.0f} rps under cProfile ({client})")
                log(f"profile {name}: {out['cells'][-1]}")
        finally:
            # A supervisor stops its workers first (each dumps its cProfile stats on the way out); on a loaded
            # machine that took longer than the default 10 s, the SIGKILL lost every stats file.
            p.stop(grace=90.0)
            self.procs.pop(f"{name}-profiled", None)
        files = sorted(pdir.glob("*.prof")) if pdir.exists() else []
        if not files:
            return {**out, "error": "the profiled gateway wrote no stats"}
        out.update(cprofile_gateway.summarize(*files))
        out["processes"] = len(files)
        out["us_per_request"] = round(1e6 * out["busy_s"] / max(1, out["requests"]))
        log(f"profile {name} ({len(files)} processes, {out['us_per_request']} µs busy per request):\n"
            + cprofile_gateway.describe(out))
        return out


def inner(args: argparse.Namespace) -> None:
    world = World(os.environ[WORLD_ENV])
    workdir = Path(tempfile.mkdtemp(prefix="egB-state-"))
    driver = Driver(args, world, workdir)
    result: dict = {}
    try:
        driver.start()
        result["unavailable"] = driver.unavailable
        result["http_client"] = "wrk" if driver.wrk_why is None else f"python ({driver.wrk_why})"
        result["commands"] = {k: p.info["cmd"] for k, p in driver.procs.items() if p.info.get("cmd")}
        rows = driver.matrix() if driver.available() else []
        result.update({"rows": rows, "summary": state_report.summarize(rows)})
        result["budget"] = driver.budget() if args.budget_n > 0 else []
        result["profiles"] = driver.profiles(list(dict.fromkeys(args.profile)))
    finally:
        driver.stop()
        Path(os.environ[RESULT_ENV]).write_text(json.dumps(result, indent=1, default=str))
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def outer(args: argparse.Namespace, argv: list[str]) -> int:
    if os.geteuid() != 0:
        print("make bench-state needs root (it creates network namespaces)", file=sys.stderr)
        return 2
    command = shlex.join([".venv/bin/python", "-m", "loadtests.state_bench", *argv])
    if args.base_src is not None:  # inherited by the driver in the client namespace (state_procs reads it)
        os.environ[state_procs.BASE_SRC_ENV] = str(args.base_src.resolve())
    meta = {"command": command, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "git": bench_report.git_state(ROOT), "mitmproxy": bench_report.version("mitmproxy"),
            "redis_py": bench_report.version("redis"), "python": sys.version.split()[0]}
    meta["load_start"] = bench_load.idle_sample()
    log(bench_load.describe("load at start", meta["load_start"]))
    meter = bench_load.RunMeter()
    meter.start()
    world = World.create()
    meta["world"] = world.tag
    result_file = Path(tempfile.mkstemp(prefix="egB-state-result-")[1])
    try:
        env = {**os.environ, WORLD_ENV: world.tag, RESULT_ENV: str(result_file)}
        rc = subprocess.run([*world.exec_prefix("cli"), sys.executable, "-m", "loadtests.state_bench", *argv],
                            env=env, cwd=ROOT, timeout=args.timeout).returncode
        result = json.loads(result_file.read_text() or "{}")
    finally:
        world.destroy()
        result_file.unlink(missing_ok=True)
    meta["load_run"] = meter.read()
    meta["load_end"] = bench_load.idle_sample()
    log(bench_load.describe("load at end", meta["load_end"]))
    log(bench_load.describe_run(meta["load_run"]))
    if not result.get("summary"):
        print(f"bench-state failed (driver exit code {rc}); see the log above", file=sys.stderr)
        return rc or 1
    meta["noisy"] = bench_load.noisy(meta["load_start"], meta["load_end"], meta["load_run"])
    report = {"meta": meta, **result}
    md = state_report.markdown(report)
    print(md)
    for p in state_report.write(report, md, args.out_dir):
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
    ap.add_argument("--body-bytes", type=int, default=1024)
    ap.add_argument("--modes", nargs="+", default=["http", "https"], choices=["http", "https"])
    ap.add_argument("--candidates", nargs="+", default=[n for n in NAMES if n != "redis-setsid"
                                                         and not state_procs.CANDIDATES[n].base], choices=NAMES)
    ap.add_argument("--base-src", type=Path, help="the tree the *-base candidates run (e.g. `git archive main`)")
    ap.add_argument("--http-client", choices=["wrk", "python"], default="wrk",
                    help="plain-HTTP client (wrk when installed; HTTPS always uses loadtests/loadgen.py)")
    ap.add_argument("--budget-n", type=int, default=20000, help="reserve_out calls per budget-check case (0: skip)")
    ap.add_argument("--profile", nargs="*", default=[], choices=NAMES,
                    help="after the measured cells: this candidate's gateway (all its processes) under cProfile, a "
                         "c=32 cell per mode (a measured candidate's own gateway, started with the hook off)")
    ap.add_argument("--profile-concurrency", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 s cells, 1 repeat, 2000 budget calls")
    ap.add_argument("--record", action="store_true", help="append the table and the command to RESULTS.md")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "loadtests" / "results")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, audit files, Redis data)")
    if "--quick" in argv:
        ap.set_defaults(seconds=2.0, repeats=1, budget_n=2000)
    return ap.parse_args(argv)


def main() -> None:
    argv = sys.argv[1:]
    args = parse(argv)
    if os.environ.get(WORLD_ENV):
        inner(args)
        return
    sys.exit(outer(args, argv))


if __name__ == "__main__":
    main()
