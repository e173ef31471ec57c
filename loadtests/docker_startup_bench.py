"""Start-up overhead of `egressgate sandbox run --runtime docker|gvisor -- true` over the bare runtime
(`docker run --rm --network none [--runtime runsc] IMG true`). Goal (issue 10): <= 300 ms.

Everything runs inside a closed test world (tests/networld) with the test suite's private dockerd
(tests/support/dockerd.py) and the real gateway on loopback in the world's gw namespace, exactly as the
runtime tests do. Run as root:

    PYTHONPATH=$PWD .venv/bin/python -m loadtests.docker_startup_bench [--runs 15]

With `--baseline TREE` (a checkout of an earlier commit, e.g. `git archive h10-docker | tar -x -C TREE`)
each round also runs TREE's `sandbox run` (PYTHONPATH=TREE), so before and after are measured interleaved
in one invocation, under the same machine noise.

Prints one JSON object (medians in ms, overhead, ratio) and writes it to
loadtests/results/docker_startup.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from tests.networld import World  # noqa: E402
from tests.runtimes.harness import Gateway, base_dir, remove  # noqa: E402
from tests.support.dockerd import running  # noqa: E402

POLICY = {"sandbox": {"name": "bench"}, "network": {"dns": {"allow": ["api.allowed.test"]}}}


def timed(argv: list[str], env: dict[str, str]) -> float:
    begin = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    elapsed = (time.perf_counter() - begin) * 1000
    if res.returncode != 0:
        raise RuntimeError(f"{argv} failed ({res.returncode}): {res.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--baseline", type=Path, help="an earlier source tree to time interleaved")
    parser.add_argument("--workspace", action="store_true",
                        help="the policy has a (temporary, unbounded) workspace: docker binds it nosuid (issue 20)")
    args = parser.parse_args()
    results: dict[str, object] = {"runs": args.runs, "workspace": args.workspace}
    policy = POLICY
    if args.workspace:
        policy = {**POLICY, "sandbox": {**POLICY["sandbox"], "workspace": {"path": "/workspace"}}}
    with tempfile.TemporaryDirectory(prefix="egD-bench-") as tmp, running(Path(tmp) / "dockerd") as dockerd:
        img = dockerd.busybox_image()
        (Path(tmp) / "world").mkdir()
        world = World.create(Path(tmp) / "world")
        base = base_dir()
        gw = Gateway.start(world, base, {"bench": policy})
        try:
            env = {**gw.caller_env(), "DOCKER_HOST": dockerd.host}
            for runtime, oci in (("docker", []), ("gvisor", ["--runtime", "runsc"])):
                bare = ["nsenter", f"--net=/run/netns/{world.gw}", "/usr/bin/docker", "run", "--rm", "--network",
                        "none", *oci, img, "true"]
                ours = gw.cmd("sandbox", "run", "--config", str(gw.config), "--policy", "bench", "--runtime",
                              runtime, "--image", img, "--", "true")
                base_env = None
                if args.baseline:
                    base_env = {**env, "PYTHONPATH": f"{args.baseline}:{args.baseline / 'tests'}"}
                timed(bare, env), timed(ours, env)  # warm-up (image probe cache, page cache)
                if base_env:
                    timed(ours, base_env)
                b, o, old = [], [], []
                for _ in range(args.runs):  # interleaved: machine noise hits all alike
                    b.append(timed(bare, env))
                    o.append(timed(ours, env))
                    if base_env:
                        old.append(timed(ours, base_env))
                mb, mo = statistics.median(b), statistics.median(o)
                results[runtime] = {"bare_ms": round(mb, 1), "sandbox_run_ms": round(mo, 1),
                                    "overhead_ms": round(mo - mb, 1), "ratio": round(mo / mb, 2),
                                    "bare_all_ms": [round(x) for x in b], "sandbox_run_all_ms": [round(x) for x in o],
                                    "bare_cmd": "docker run --rm --network none " + " ".join([*oci, img, "true"]),
                                    "sandbox_cmd": f"egressgate sandbox run --policy bench --runtime {runtime} "
                                                   f"--image {img} -- true"}
                if old:
                    mold = statistics.median(old)
                    results[runtime].update({"baseline_sandbox_run_ms": round(mold, 1),  # type: ignore[union-attr]
                                             "baseline_overhead_ms": round(mold - mb, 1),
                                             "baseline_all_ms": [round(x) for x in old]})
            # reference: the same `sandbox run` with the netns runtime (admission, plumbing, revocation
            # without any container): the part of the overhead that is not the docker adapter's
            ours = gw.cmd("sandbox", "run", "--config", str(gw.config), "--policy", "bench", "--", "/bin/true")
            timed(ours, env)
            results["netns_sandbox_run_ms"] = round(statistics.median(timed(ours, env) for _ in range(args.runs)), 1)
        finally:
            gw.stop()
            world.close()
            remove(base)
    out = ROOT / "loadtests" / "results" / "docker_startup.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
