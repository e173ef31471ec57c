"""`make bench`: run every benchmark module present in loadtests/ (`*_bench.py`) and print their results.

Each module runs as its own process (`python -m loadtests.NAME`, with its defaults) so one crashing or
hanging benchmark cannot take the others down; each is bounded by --timeout and stopped by its own pid
(its process group) when it overruns. Modules not in the tree yet are listed as missing, not errors.

    .venv/bin/python -m loadtests.run_all [--only NAME ...] [--skip NAME ...] [--timeout S]
        [--quick] [--gateway-args "--seconds 5 --repeats 1"]
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Order: the fast pure ones first, the long end-to-end gateway run last; any other `*_bench.py` that appears
# in loadtests/ (e.g. inject_bench) runs before gateway_bench, alphabetically.
KNOWN = ("decide_bench", "dns_bench", "audit_sink_bench", "broker_bench")
LAST = "gateway_bench"


def discover() -> list[str]:
    present = sorted(p.stem for p in HERE.glob("*_bench.py"))
    others = [m for m in present if m not in KNOWN and m != LAST]
    return [*KNOWN, *others, LAST]
QUICK_ARGS = {"gateway_bench": ["--seconds", "3", "--repeats", "1", "--stream-bytes", str(256 << 20)],
              "state_bench": ["--quick"]}


def run_module(name: str, extra: list[str], timeout: float) -> tuple[int | None, float]:
    cmd = [sys.executable, "-m", f"loadtests.{name}", *extra]
    print(f"\n===== {name}: {shlex.join(cmd)}", flush=True)
    start = time.monotonic()
    # Own process group: on timeout the benchmark and the servers it started are stopped together.
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        print(f"===== {name}: timed out after {timeout:.0f} s; stopping it", flush=True)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        rc = None
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
        raise
    return rc, time.monotonic() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modules = discover()
    ap.add_argument("--only", nargs="+", choices=modules)
    ap.add_argument("--skip", nargs="+", default=[], choices=modules)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per module, seconds")
    ap.add_argument("--quick", action="store_true", help="short gateway cells (smoke run, not for RESULTS.md)")
    ap.add_argument("--gateway-args", default="", help="extra arguments for gateway_bench")
    args = ap.parse_args()
    outcome: list[tuple[str, str, float]] = []
    for name in args.only or modules:
        if name in args.skip:
            continue
        if not (HERE / f"{name}.py").is_file():
            outcome.append((name, "missing (not in the tree yet)", 0.0))
            continue
        extra = list(QUICK_ARGS.get(name, [])) if args.quick else []
        if name == "gateway_bench":
            extra += shlex.split(args.gateway_args)
        rc, took = run_module(name, extra, args.timeout)
        outcome.append((name, "ok" if rc == 0 else ("TIMEOUT" if rc is None else f"FAILED (exit {rc})"), took))
    print("\n===== summary")
    for name, status, took in outcome:
        print(f"{name:18} {status:32} {took:7.1f} s")
    return 0 if all(s in ("ok",) or s.startswith("missing") for _, s, _ in outcome) else 1


if __name__ == "__main__":
    sys.exit(main())
