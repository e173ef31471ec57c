"""Start-up overhead of `egressgate sandbox run --runtime netns -- true` over bare bubblewrap (issue 10;
goal: <= 150 ms).

Both run `true`, interleaved, N times each; the figure is the difference of the medians (and their
ratio). `sandbox run` does everything a real run does: read gateway.json, allocate a /30 under flock,
admit over the admin API, `ip netns add`, veth + addresses + sysctls (ip -batch), two `nft -f`, bwrap in
the netns, teardown and the revocation with its outcome. The bare bwrap gets comparable isolation flags
(new user/pid/ipc/uts/net namespaces, read-only root, /proc, /dev, tmpfs /tmp).

Everything runs in a private network namespace this bench creates (`egN-bench-<pid>`), with a real
gateway on its loopback; nothing leaves it. Run as root:
    PYTHONPATH=$PWD .venv/bin/python -m loadtests.runtime_startup_bench [-n 30] [--baseline TREE]

With `--baseline TREE` (an export of an earlier commit: `git archive main | tar -x -C TREE`) each round
also runs TREE's `sandbox run` (PYTHONPATH=TREE), so before and after are timed interleaved, under the
same machine noise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

EGRESSGATE = str(Path(sys.executable).with_name("egressgate"))
BARE = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--proc", "/proc",
        "--dev", "/dev", "--tmpfs", "/tmp", "--cap-drop", "ALL", "true"]


def timed(argv: list[str], env: dict[str, str], phases: list[dict[str, float]] | None = None) -> float:
    begin = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=60)
    took = time.perf_counter() - begin
    if res.returncode != 0:
        raise RuntimeError(f"{argv[:6]}... exited {res.returncode}: {res.stderr[-2000:]}")
    if phases is not None:  # EGRESSGATE_RUN_TIMING=1: "egressgate: timing ms: allocate=5.9 admission=8.2 ..."
        line = next(x for x in res.stderr.splitlines() if "timing ms:" in x)
        phases.append({k: float(v) for k, v in (w.split("=") for w in line.split("timing ms:")[1].split())})
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30, help="runs of each")
    ap.add_argument("--baseline", type=Path, help="an earlier source tree to time interleaved")
    args = ap.parse_args()
    ns = f"egN-bench-{os.getpid()}"
    base = Path(tempfile.mkdtemp(prefix="egN-bench-"))
    base.chmod(0o711)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    gateway = None
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        (base / "policies").mkdir()
        (base / "policies" / "bench.yaml").write_text(yaml.safe_dump({"sandbox": {"name": "bench"}}))
        (base / "gateway.yaml").write_text(yaml.safe_dump({
            "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": "127.0.0.1:0",
                       "transparent": "127.0.0.2:0"},
            "dns": {"upstreams": ["127.0.0.1:9"]},  # never asked: the workload is `true`
            "policy": str(base / "policies"), "var_dir": str(base / "var"),
            "runtime": {"state_dir": str(base / "state")}}))
        enter = ["nsenter", f"--net=/run/netns/{ns}"]
        gateway = subprocess.Popen([*enter, EGRESSGATE, "run", "--config", str(base / "gateway.yaml")],
                                   stdout=subprocess.PIPE, stderr=open(base / "gateway.stderr", "w"), text=True)  # noqa: SIM115
        assert gateway.stdout is not None
        addresses = json.loads(gateway.stdout.readline())
        env = {**os.environ, "EGRESSGATE_RUN_TIMING": "1"}
        run = [*enter, EGRESSGATE, "sandbox", "run", "--var-dir", str(base / "var"), "--policy", "bench", "--",
               "true"]
        bare = [*enter, *BARE]
        base_env = {**env, "PYTHONPATH": str(args.baseline)} if args.baseline else None
        for _ in range(3):  # warm the page cache for both
            timed(run, env)
            timed(bare, env)
            if base_env:
                timed(run, base_env)
        old: list[float] = []
        ours: list[float] = []
        theirs: list[float] = []
        helps: list[float] = []
        phases: list[dict[str, float]] = []
        cli_only = [*enter, EGRESSGATE, "sandbox", "run", "--help"]  # interpreter + imports + click, no run
        for _ in range(args.n):
            ours.append(timed(run, env, phases))
            theirs.append(timed(bare, env))
            helps.append(timed(cli_only, env))
            if base_env:
                old.append(timed(run, base_env))
        m_ours, m_bare = statistics.median(ours), statistics.median(theirs)
        extra = {"baseline_sandbox_run_median_ms": round(statistics.median(old) * 1000, 1),
                 "baseline_overhead_ms": round((statistics.median(old) - m_bare) * 1000, 1)} if old else {}
        print(json.dumps({**extra,
            "n": args.n, "gateway": addresses,
            "sandbox_run_median_ms": round(m_ours * 1000, 1), "bwrap_median_ms": round(m_bare * 1000, 1),
            "overhead_ms": round((m_ours - m_bare) * 1000, 1), "ratio": round(m_ours / m_bare, 2),
            "sandbox_run_p90_ms": round(sorted(ours)[int(0.9 * (len(ours) - 1))] * 1000, 1),
            "bwrap_p90_ms": round(sorted(theirs)[int(0.9 * (len(theirs) - 1))] * 1000, 1),
            "cli_startup_median_ms": round(statistics.median(helps) * 1000, 1),
            "phase_medians_ms": {k: round(statistics.median(p[k] for p in phases), 1) for k in phases[0]},
            "load_avg": os.getloadavg(),
        }, indent=1))
    finally:
        if gateway is not None and gateway.poll() is None:
            gateway.send_signal(signal.SIGTERM)
            try:
                gateway.wait(10)
            except subprocess.TimeoutExpired:
                gateway.kill()
        subprocess.run(["ip", "netns", "del", ns], check=False)
        subprocess.run(["rm", "-rf", str(base)], check=False)


if __name__ == "__main__":
    main()
