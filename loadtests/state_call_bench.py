"""CPU and latency of what an allowed request asks of the Redis state store: `snapshot` + `reserve_request`.

    python -m loadtests.state_call_bench [--base-src DIR] [--reps 11] [-n 3000]

Each variant runs in its own process (the gateway's `RedisState`, a private redis-server on a free loopback
port, never 6379), N sequential pairs after a warm-up, and prints CPU µs per pair (`time.process_time`, the
caller's user+system time: packing, parsing, the event loop, the socket syscalls) and the pair's p50. The
variants run interleaved, `--reps` times: `this` (this tree), `this-pure` (this tree with the pure-Python
RESP packer and reader instead of hiredis: what the hiredis dependency buys) and, with `--base-src`, `base`
(another tree, PYTHONPATH ahead of the editable install). Paired ratios are per repetition, then the median.
Figures on a loaded machine swing: print the load (it does) and quote medians.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import asyncio, json, sys, time
from pathlib import Path
from egressgate.state.base import SandboxRecord, hash_token
from egressgate.state.redis import RedisState
import egressgate.state.resp as resp
if sys.argv[3] == "this-pure":
    resp._Reader, resp._pack = resp._PyReader, resp.pack

async def main(url, n):
    st = RedisState(url, key_prefix=f"callbench{time.monotonic_ns()}:")
    await st.start()
    await st.admit(SandboxRecord(id="s1", token_hash=hash_token("t"), policy_name="p", admitted_at=time.time()))
    async def pair():
        await st.snapshot("s1", history=(), rules=frozenset())
        await st.reserve_request("s1", "example.com", "r1", 10, 1024, 1 << 50)
    for _ in range(300):
        await pair()
    lat = []
    cpu0 = time.process_time()
    for _ in range(n):
        t = time.perf_counter_ns()
        await pair()
        lat.append(time.perf_counter_ns() - t)
    cpu = time.process_time() - cpu0
    await st.close()
    lat.sort()
    print(json.dumps({"cpu_us": round(cpu / n * 1e6, 1), "p50_us": round(lat[n // 2] / 1000, 1),
                      "tree": str(Path(resp.__file__).parents[2])}))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-src", type=Path)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("-n", type=int, default=3000)
    args = ap.parse_args()
    variants = ["this", "this-pure"] + (["base"] if args.base_src else [])
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        server = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                data,
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)
            print("load at start:", Path("/proc/loadavg").read_text().strip())
            rows: dict[str, list[dict]] = {v: [] for v in variants}
            for rep in range(args.reps):
                for variant in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
                    env = dict(os.environ)
                    if variant == "base":
                        env["PYTHONPATH"] = str(args.base_src)
                    out = subprocess.run(
                        [sys.executable, "-c", CHILD, f"redis://127.0.0.1:{port}/0", str(args.n), variant],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                        cwd=data,
                    )  # not this tree's root: `-c` puts the cwd first on sys.path
                    rows[variant].append(json.loads(out.stdout))
            print("load at end:", Path("/proc/loadavg").read_text().strip())
        finally:
            server.terminate()
            server.wait()
    for variant, r in rows.items():
        print(f"{variant:10s} ran {sorted({x['tree'] for x in r})}")
        print(
            f"{variant:10s} CPU µs per pair median {statistics.median(x['cpu_us'] for x in r):6.1f}  "
            f"p50 µs median {statistics.median(x['p50_us'] for x in r):6.1f}  CPU per rep {[x['cpu_us'] for x in r]}"
        )
    for other in variants[1:]:
        cpu = statistics.median(a["cpu_us"] / b["cpu_us"] for a, b in zip(rows["this"], rows[other], strict=True))
        p50 = statistics.median(a["p50_us"] / b["p50_us"] for a, b in zip(rows["this"], rows[other], strict=True))
        print(f"paired this / {other}: CPU {cpu:.2f}x, p50 {p50:.2f}x (median of {args.reps} repetitions)")


if __name__ == "__main__":
    main()
