"""Where one c=1 request's time goes in `egressgate run`, and how many syscalls and loop rounds it costs.

    PYTHONPATH=$PWD .venv/bin/python -m loadtests.c1_profile https [--seconds 8] [--out FILE.prof]

Starts the upstream and a gateway under cProfile (loadtests/cprofile_gateway.py: profiling only while the
load runs) on loopback, runs one keep-alive client (1 KiB GETs) for `--seconds`, then prints the component
split (cprofile_gateway's summary) and, per request, the counts that do not depend on how loaded the
machine is: `send`/`recv` syscalls, event-loop iterations (one `epoll_wait` each), lock acquisitions,
futures and tasks created. The times are wall-clock and inflated by cProfile (and by other load: a
preempted process is charged to the syscall it was in), the counts are exact; compare trees by counts,
and by interleaved `make bench` runs (`--baseline`) for time. Issue 25 item 3 (loadtests/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import pstats
import signal
import sys
import tempfile
from pathlib import Path

import yaml

from loadtests import cprofile_gateway, procs
from loadtests.loadgen import Target, run_cell

COUNTED = {
    "send syscalls": ("<method 'send' of '_socket.socket' objects>", None),
    "recv syscalls": ("<method 'recv' of '_socket.socket' objects>", None),
    "event-loop iterations": ("_run_once", "base_events"),
    "lock acquisitions": ("acquire", "locks"),
    "futures created": ("create_future", "base_events"),
    "tasks created": ("create_task", "tasks.py"),
}


def counts(prof: Path, requests: int) -> dict[str, float]:
    """Calls per request of the functions in COUNTED."""
    stats = pstats.Stats(str(prof)).stats  # type: ignore[attr-defined]
    out = dict.fromkeys(COUNTED, 0.0)
    for (filename, _line, func), (_cc, ncalls, *_rest) in stats.items():
        for label, (name, where) in COUNTED.items():
            if func == name and (where is None or where in filename):
                out[label] += ncalls / requests
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["http", "https"])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", type=Path, default=None, help="keep the profile here (default: a temp file)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="egressgate-c1-profile-"))
    out = args.out or work / "gateway.prof"
    certs = procs.make_certs(work)
    up = procs.start_upstream(certs, work)
    gw = None
    try:
        d = work / "egressgate"
        (d / "policies").mkdir(parents=True)
        policy = procs.bench_policy(up.info["http_port"], up.info["https_port"])
        (d / "policies" / "bench.yaml").write_text(yaml.safe_dump(policy))
        listen = {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None}
        program = [sys.executable, "-m", "loadtests.cprofile_gateway", str(out), "--", "run"]
        gw = procs.launch_egressgate(d, certs.ca_pem, listen, {"sandbox": "bench"}, program=program)
        target = Target(
            scheme=args.mode,
            host=procs.UPSTREAM_NAME,
            port=up.info[f"{args.mode}_port"],
            dial=("127.0.0.1", gw.info["port"]),
            via_proxy=True,
            ca_file=gw.info["ca"] if args.mode == "https" else None,
            proxy_auth=gw.info["sandbox"],
            path="/bytes/1024",
            expect_body=1024,
        )
        run_cell(target, 1, 1.0)  # warm: connection, TLS, caches
        os.kill(gw.pid, signal.SIGUSR1)
        result = run_cell(target, 1, args.seconds)
        os.kill(gw.pid, signal.SIGUSR2)
    finally:
        if gw is not None:
            gw.stop(30)
        up.stop()
    print(
        f"profiled {result.ok} requests ({result.rps:.0f} rps under cProfile, p50 {result.p50_ms:.2f} ms; "
        f"loadavg {' '.join(Path('/proc/loadavg').read_text().split()[:3])})"
    )
    print(cprofile_gateway.describe(cprofile_gateway.summarize(out)))
    print("per request (exact counts):")
    for label, n in counts(out, max(1, result.ok)).items():
        print(f"  {n:6.2f}  {label}")


if __name__ == "__main__":
    main()
