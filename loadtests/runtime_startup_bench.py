"""Start-up overhead of `egressgate sandbox run --runtime netns -- true` over bare bubblewrap (issue 10;
goal: <= 150 ms).

Both run `true`, interleaved, N times each; the figure is the difference of the medians (and their
ratio). `sandbox run` does everything a real run does: read gateway.json, allocate a /30 under flock,
admit over the admin API, `ip netns add`, veth + addresses + sysctls (ip -batch), two `nft -f`, bwrap in
the netns, teardown and the revocation with its outcome. The bare bwrap gets comparable isolation flags
(new user/pid/ipc/uts/net namespaces, read-only root, /proc, /dev, tmpfs /tmp).

Everything runs in a private network namespace this bench creates (`egN-bench-<pid>`), with a real
gateway on its loopback; nothing leaves it. Run as root:
    PYTHONPATH=$PWD .venv/bin/python -m loadtests.runtime_startup_bench [-n 30] [--source]

Bytecode: an installed egressgate has its modules compiled (`pip install` writes the .pyc files), so the
bench compiles the egressgate package it imports (`compileall` into the gitignored __pycache__ dirs)
before measuring. A source checkout run with PYTHONDONTWRITEBYTECODE=1 (as this dev environment sets)
recompiles every module at each start (+~23 ms): `--source` measures that instead (it moves the
package's __pycache__ dirs aside for the duration and puts them back).

Before/after on a shared machine: `--baseline DIR` also times `sandbox run` importing egressgate from DIR
(e.g. `git archive <commit> | tar -x -C DIR`), interleaved with the others in the same loop, so both see
the same load (same bytecode mode; the gateway is the current tree's).
"""

from __future__ import annotations

import argparse
import compileall
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


def package_dir(env: dict[str, str]) -> Path:
    """The egressgate package the runs import (PYTHONPATH decides, as for them)."""
    out = subprocess.run([sys.executable, "-c", "import egressgate; print(egressgate.__path__[0])"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def set_bytecode(pkg: Path, compiled: bool) -> list[Path]:
    """Compile the package, or move its __pycache__ dirs aside (returned, for restore_bytecode)."""
    if compiled:
        compileall.compile_dir(str(pkg), quiet=1)
        return []
    aside = []
    for cache in sorted(pkg.rglob("__pycache__")):
        cache.rename(cache.with_name("__pycache__.bench-aside"))
        aside.append(cache)
    return aside


def restore_bytecode(aside: list[Path]) -> None:
    for cache in aside:
        cache.with_name("__pycache__.bench-aside").rename(cache)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30, help="runs of each")
    ap.add_argument("--source", action="store_true", help="no compiled bytecode for egressgate (see above)")
    ap.add_argument("--baseline", help="a source tree whose `sandbox run` is timed too, interleaved")
    args = ap.parse_args()
    base_env = None
    if args.baseline:
        base_env = {**os.environ, "PYTHONPATH": str(Path(args.baseline).absolute())}
    aside = []
    for env_of in ([dict(os.environ)] + ([base_env] if base_env else [])):
        aside += set_bytecode(package_dir(env_of), compiled=not args.source)
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
        for _ in range(3):  # warm the page cache for both
            timed(run, env)
            timed(bare, env)
            if base_env is not None:
                timed(run, base_env)
        ours: list[float] = []
        theirs: list[float] = []
        helps: list[float] = []
        baseline: list[float] = []
        phases: list[dict[str, float]] = []
        cli_only = [*enter, EGRESSGATE, "sandbox", "run", "--help"]  # interpreter + imports + click, no run
        for _ in range(args.n):
            ours.append(timed(run, env, phases))
            theirs.append(timed(bare, env))
            helps.append(timed(cli_only, env))
            if base_env is not None:
                baseline.append(timed(run, {**base_env, "EGRESSGATE_RUN_TIMING": "1"}))
        m_ours, m_bare = statistics.median(ours), statistics.median(theirs)
        print(json.dumps({
            "n": args.n, "gateway": addresses,
            "sandbox_run_median_ms": round(m_ours * 1000, 1), "bwrap_median_ms": round(m_bare * 1000, 1),
            "overhead_ms": round((m_ours - m_bare) * 1000, 1), "ratio": round(m_ours / m_bare, 2),
            "sandbox_run_p90_ms": round(sorted(ours)[int(0.9 * (len(ours) - 1))] * 1000, 1),
            "bwrap_p90_ms": round(sorted(theirs)[int(0.9 * (len(theirs) - 1))] * 1000, 1),
            "cli_startup_median_ms": round(statistics.median(helps) * 1000, 1),
            **({"baseline": args.baseline, "baseline_median_ms": round(statistics.median(baseline) * 1000, 1),
                "baseline_overhead_ms": round((statistics.median(baseline) - m_bare) * 1000, 1)} if baseline else {}),
            "phase_medians_ms": {k: round(statistics.median(p[k] for p in phases), 1) for k in phases[0]},
            "bytecode": "source" if args.source else "compiled", "load_avg": os.getloadavg(),
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
        restore_bytecode(aside)


if __name__ == "__main__":
    main()
