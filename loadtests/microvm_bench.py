"""The microvm runtime (issue 24): boot-to-command and transparent HTTPS, against netns, in one run.

    PYTHONPATH=$PWD .venv/bin/python -m loadtests.microvm_bench [--runs 9] [--requests 30]

Everything runs in a closed test world (tests/networld) with the real gateway on loopback in its gw
namespace, exactly as tests/runtimes/test_microvm.py does (root; the artifacts from `egressgate runtime
image build`). Interleaved rounds, so machine noise hits both runtimes alike:

* boot-to-command: `sandbox run ... -- /bin/echo ready`, the time from starting `sandbox run` to the line
  arriving on its stdout (admission, plumbing, QEMU start, guest kernel boot, init, the command), and the
  whole run (plus the guest's power-off, teardown and revocation). Goal: median <= 3 s under TCG.
  On a shared machine the wall times follow the load (printed); the CPU seconds of the run (QEMU's
  above all) do not, and on an idle core the boot takes about that long.
* transparent HTTPS: one python3 workload per runtime making N sequential GETs to https://api.allowed.test/
  with no proxy (the transparent listener intercepts; the client trusts /etc/egressgate/ca.pem), timed
  inside the workload (so boot does not count): requests per second and the median request.

Prints one JSON object; writes loadtests/results/microvm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from egressgate.runtimes.microvm import artifacts  # noqa: E402
from tests.runtimes.harness import Gateway, running_gateway, runtime_policy, sandbox_world  # noqa: E402

CLIENT = """
import json, ssl, sys, time, urllib.request
ctx = ssl.create_default_context(cafile="/etc/egressgate/ca.pem")
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
took = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    with opener.open("https://api.allowed.test/", timeout=30) as r:
        r.read()
        assert r.status == 200
    took.append(time.perf_counter() - t)
print(json.dumps(took))
"""


def argv(gw: Gateway, runtime: str, *command: str) -> list[str]:
    return gw.cmd(
        "sandbox", "run", "--config", str(gw.config), "--policy", "bench", "--runtime", runtime, "--", *command
    )


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def boot(gw: Gateway, runtime: str, env: dict[str, str]) -> tuple[float, float, float]:
    """(seconds to the command's output line, seconds for the whole run, CPU seconds of `sandbox run` and
    everything it waited for: QEMU, ip, nft; not the gateway). On a loaded machine the CPU time is the
    figure that does not depend on the neighbours: the boot is one vCPU thread, so on an idle core wall
    time is about this."""
    cpu = children_cpu()
    begin = time.perf_counter()
    proc = subprocess.Popen(
        argv(gw, runtime, "/bin/echo", "ready"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    first = time.perf_counter() - begin
    _, err = proc.communicate(timeout=120)
    total = time.perf_counter() - begin
    if line != "ready\n" or proc.returncode != 0:
        raise RuntimeError(f"{runtime}: {line!r} exit {proc.returncode}: {err[-2000:]}")
    return first, total, children_cpu() - cpu


def https(gw: Gateway, runtime: str, env: dict[str, str], requests: int) -> list[float]:
    res = subprocess.run(
        argv(gw, runtime, "/usr/bin/python3", "-c", CLIENT, str(requests)),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(f"{runtime} https: exit {res.returncode}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    runtimes = ("microvm", "netns")
    firsts: dict[str, list[float]] = {r: [] for r in runtimes}
    totals: dict[str, list[float]] = {r: [] for r in runtimes}
    cpus: dict[str, list[float]] = {r: [] for r in runtimes}
    gets: dict[str, list[float]] = {r: [] for r in runtimes}
    policy = runtime_policy("bench", sandbox__workspace=None)
    with (
        tempfile.TemporaryDirectory(prefix="egV-bench-") as tmp,
        sandbox_world(Path(tmp)) as world,
        running_gateway(world, {"bench": policy}) as gw,
    ):
        env = gw.caller_env()
        for runtime in runtimes:  # warm-up: page cache, the KVM probe's cache
            boot(gw, runtime, env)
        for _ in range(args.runs):
            for runtime in runtimes:
                first, total, cpu = boot(gw, runtime, env)
                firsts[runtime].append(first)
                totals[runtime].append(total)
                cpus[runtime].append(cpu)
        for _ in range(2):
            for runtime in runtimes:
                gets[runtime] += https(gw, runtime, env, args.requests)
    accel = os.environ.get("EGRESSGATE_MICROVM_ACCEL") or json.loads(
        (artifacts.cache_dir() / "accel.json").read_text()
    ).get("accel")

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1000, 1)

    results = {
        "runs": args.runs,
        "requests_per_workload": args.requests,
        "accel": accel,
        "load_avg": os.getloadavg(),
        "boot_to_command_ms": {r: ms(firsts[r]) for r in runtimes},
        "boot_to_command_all_ms": {r: [round(x * 1000) for x in firsts[r]] for r in runtimes},
        "whole_run_ms": {r: ms(totals[r]) for r in runtimes},
        "whole_run_cpu_ms": {r: ms(cpus[r]) for r in runtimes},
        "https_request_median_ms": {r: ms(gets[r]) for r in runtimes},
        "https_rps": {r: round(len(gets[r]) / sum(gets[r]), 1) for r in runtimes},
        "command": "PYTHONPATH=$PWD .venv/bin/python -m loadtests.microvm_bench "
        f"--runs {args.runs} --requests {args.requests}",
    }
    out = ROOT / "loadtests" / "results" / "microvm.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
