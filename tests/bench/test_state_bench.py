"""`make bench-state` (loadtests/state_bench.py and helpers) keeps working and reports what it measured.

- A tiny real run in its own namespace world: every candidate this tree can start serves 200s with the full
  body through the pipeline, gateway CPU is read for the whole worker tree, the budget check is timed.
- The /proc tree walk counts a forked worker's CPU (the per-CPU-second figure of `--workers 2` rests on it).
- wrk as a forward-proxy client sends absolute-form requests with the sandbox's Proxy-Authorization, and a
  deny is never counted as throughput (positive control: the same server answering 200).
- cProfile (no py-spy here) sees the gateway's request path when switched on around a load cell.
- The ratios and goal marks are checked against hand-computed values.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loadtests import state_procs, state_report, wrk_proxy
from loadtests.loadgen import Target
from loadtests.state_report import summarize

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_state_bench_runs_end_to_end_in_tiny_mode(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("EGB_STATE_WORLD", None)
    # tiny: half-second cells (wrk's take 1 s, its minimum), c=2, 200 budget calls, and one profiled gateway at
    # c=2 -- redis-2w, whose supervisor and two workers take every profiling path a one-process gateway takes;
    # it is the measured redis-2w itself, profiled after its cells (one gateway start less)
    cmd = [sys.executable, "-m", "loadtests.state_bench", "--seconds", "0.5", "--repeats", "1", "--concurrency", "2",
           "--budget-n", "200", "--profile", "redis-2w", "--profile-concurrency", "2", "--out-dir", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(next(tmp_path.glob("bench-state-*.json")).read_text())
    cells = {(s["mode"], s["candidate"]): s for s in report["summary"]}
    served = sorted({s["candidate"] for s in report["summary"]})
    assert served == ["memory", "redis", "redis-2w"] and not report["unavailable"], report["unavailable"]
    for cand in served:
        for mode in ("http", "https"):
            s = cells[(mode, cand)]
            assert s["rps"] > 0 and s["errors"] == 0 and s["upstream_short"] == 0, s
            assert s["gateway_cores"] > 0 and s["req_per_cpu_s"] > 0, s
    if shutil.which("wrk"):
        assert cells[("http", "memory")]["client"] == "wrk"
    rows = [r for r in report["rows"] if r["candidate"] == "redis-2w"]
    assert rows and all(r["gateway_pids"] == 3 for r in rows), rows  # the supervisor and two workers
    for cand in ("redis", "redis-2w"):
        if cand in served:  # the gateway really used Redis: its script ran for the requests
            calls = cells[("https", cand)]["redis_calls_per_req"]
            assert sum(calls.values()) >= 1, calls
    budget = {b["case"].split(",")[0] + "/" + b["case"].split(",")[1].split()[0]: b for b in report["budget"]}
    assert set(budget) == {"memory/sequential", "redis/sequential", "redis/32", "redis/paced"}, list(budget)
    for b in budget.values():
        assert "error" not in b and b["reserve_out"]["calls"] > 0 and b["reserve_out"]["p99_us"] > 0, b
    assert budget["redis/sequential"]["reserve_out"]["calls"] == 200
    assert set(report["profiles"]) == {"redis-2w"}, list(report["profiles"])
    prof = report["profiles"]["redis-2w"]  # cProfile saw the request path, not only start-up
    assert prof["in_place"], prof  # the measured gateway itself, profiled after its cells: no second start
    assert "error" not in prof, prof
    assert prof["busy_s"] > 0 and prof["components_self_pct"].get("egressgate.policy (decide/canon)", 0) > 0, prof
    assert any("snapshot" in w for w, _us, _n in prof["state_inclusive"]), prof["state_inclusive"]
    # the workers were profiled too, not only the supervisor
    assert prof["processes"] == 3 and prof["components_self_pct"].get("egressgate.state", 0) > 0, prof
    md = next(tmp_path.glob("bench-state-*.md")).read_text()
    assert "loadavg" in md and "req per gateway CPU-s" in md and report["meta"]["command"] in md
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert report["meta"]["world"].startswith("egB-") and report["meta"]["world"] not in listed


BURN = ("import os, time\npid = os.fork()\nif pid == 0:\n    end = time.process_time() + 0.6\n"
        "    while time.process_time() < end: pass\n    time.sleep(30)\n    os._exit(0)\n"
        "print('forked', flush=True)\ntime.sleep(30)")


def test_tree_cpu_counts_forked_workers() -> None:
    parent = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "forked"
        deadline = time.monotonic() + 20
        while state_procs.tree_cpu_seconds(parent.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(state_procs.tree_pids(parent.pid)) == 2
        assert state_procs.tree_cpu_seconds(parent.pid) >= 0.5
        own = Path(f"/proc/{parent.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert (int(own[11]) + int(own[12])) / state_procs.HZ < 0.3  # the parent alone would hide the worker
    finally:
        for pid in state_procs.tree_pids(parent.pid)[1:]:
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


class Recorder:
    """A loopback HTTP/1.1 server answering every request with `status`, keeping the request heads."""

    def __init__(self, status: int) -> None:
        self.status, self.heads = status, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        body = b"x" * 16
        reply = f"HTTP/1.1 {self.status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        buf = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                while b"\r\n\r\n" in buf:
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    if len(self.heads) < 50:
                        self.heads.append(head.decode())
                    conn.sendall(reply)


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed (scripts/install-test-deps.sh)")
@pytest.mark.parametrize("status", [403, 200])
def test_wrk_speaks_forward_proxy_and_never_counts_a_deny(status: int) -> None:
    server = Recorder(status)
    try:
        target = Target(scheme="http", host="upstream.bench.test", port=8080, dial=("127.0.0.1", server.port),
                        via_proxy=True, proxy_auth=("sbx-1", "tok"), path="/bytes/16")
        r = wrk_proxy.run_cell(target, 2, 1)
    finally:
        server.sock.close()
    head = server.heads[0]
    assert head.startswith("GET http://upstream.bench.test:8080/bytes/16 HTTP/1.1\r\n"), head
    assert "Host: upstream.bench.test:8080" in head and "Proxy-Authorization: Basic c2J4LTE6dG9r" in head
    if status == 403:
        assert r.ok == 0 and r.rps == 0 and r.errors["status"] > 0, r
    else:
        assert r.ok > 10 and r.rps > 0 and not r.errors, r


def row(mode: str, conc: int, cand: str, rps: float, cores: float, rep: int = 0) -> dict:
    return {"rep": rep, "mode": mode, "conc": conc, "candidate": cand, "rps": rps, "p50_ms": 1.0, "p99_ms": 3.0,
            "errors": {}, "requests": int(rps), "gateway_cores": cores, "client_cores": 0.1, "client": "wrk",
            "upstream_requests": int(rps) + 5, "gateway_pids": 1}


def test_ratios_and_goal_marks_match_hand_computed_values() -> None:
    rows = [row("http", 32, "memory", 1000, 1.0), row("http", 32, "memory", 1200, 1.0, rep=1),
            row("http", 32, "memory", 1100, 1.0, rep=2),  # median 1100 rps, 1100 req/CPU-s
            row("http", 32, "redis", 900, 1.0), row("http", 32, "redis", 1000, 1.0, rep=1),  # median 950
            row("http", 32, "redis-2w", 1520, 2.0), row("http", 32, "redis-2w", 1425, 1.5, rep=1)]
    rows[3]["redis_commands"] = {"evalsha": 1800}  # 1800 calls over 905 upstream requests
    summary = summarize(rows)
    by = {s["candidate"]: s for s in summary}
    assert by["memory"]["rps"] == 1100 and by["redis"]["rps"] == 950 and by["redis-2w"]["rps"] == 1472.5
    assert by["redis-2w"]["req_per_cpu_s"] == pytest.approx((760 + 950) / 2)
    assert by["redis"]["redis_calls_per_req"] == {"evalsha": round(1800 / 905, 2)}
    (r,) = state_report.ratios(summary)
    assert r["redis_vs_memory"] == pytest.approx(950 / 1100)  # 0.86: below the 0.9 goal
    assert r["w2_vs_w1"] == pytest.approx(1472.5 / 950)  # 1.55: below the 1.6 goal
    report = {"meta": {"started": "t", "git": "g", "command": "c", "mitmproxy": "m", "redis_py": "r",
                       "python": "p", "load_start": {"cpus": 2, "loadavg": [0, 0, 0], "others_pct": 0,
                                                     "steal_pct": 0},
                       "load_end": {"loadavg": [0, 0, 0], "others_pct": 0, "steal_pct": 0},
                       "load_run": {"wall_s": 1, "others_cores": 0, "bench_cores": 1, "steal_pct": 0}},
              "summary": summary,
              "budget": [{"case": "redis, sequential", "reserve_out": {"calls": 9, "p50_us": 200, "p90_us": 300,
                                                                       "p99_us": 1200, "p999_us": 2000,
                                                                       "max_us": 3000},
                          "settle_out": {"p99_us": 100}}]}
    md = state_report.markdown(report)
    ratio_line = next(line for line in md.splitlines() if line.startswith("| http | 32 | 0.86x"))
    assert ratio_line.count("**not met**") == 2, ratio_line
    budget_line = next(line for line in md.splitlines() if line.startswith("| redis, sequential"))
    assert "1200.0 (**not met**)" in budget_line
