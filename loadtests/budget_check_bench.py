"""Latency of the budget check: the state store's `reserve_out` (a Lua script on Redis), as the gateway calls it.

    python -m loadtests.budget_check_bench [--backend redis|memory] [--url redis://127.0.0.1:P/0] [-n 20000]

Each call is timed from the caller's side (`time.perf_counter_ns` around `await store.reserve_out(...)`):
what a request waits for, i.e. the Lua script's run time plus the round trip, redis-py's encoding/parsing and
the event loop's turn. Then `settle_out` gives the lease back (timed separately: it runs when a flow ends,
not on the request's path). The store is opened with the gateway's own factory (`egressgate.state.open_state`),
the sandbox admitted with `admit()`, so the measured code is the gateway's, not a copy.

Modes: sequential (`--concurrency 1`: one call at a time, the script's own cost); `--concurrency N` (N tasks on
one event loop sharing the store's connection pool, as a loaded gateway has them); `--duration S --pace-ms P`
(one call every P ms for S seconds: a light probe run while the gateway is under load, so the figure includes
the machine's scheduling delays). Without `--url` a private redis-server is started on a free loopback port
in a temp dir and stopped at the end (never port 6379, never a Redis it did not start).
Output: one JSON line (`--json`) or a short text summary. The bench-state driver runs it inside the bench
world's gateway namespace against the Redis the gateways use (loadtests/state_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

LIMIT = 1 << 50  # the bench policy's outbound_bytes_max: never reached, so every call grants


def pct(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile in microseconds."""
    if not sorted_ns:
        return float("nan")
    k = min(len(sorted_ns) - 1, max(0, round(q * (len(sorted_ns) - 1))))
    return sorted_ns[k] / 1000


def stats(ns: list[int]) -> dict:
    s = sorted(ns)
    return {"calls": len(s), "p50_us": pct(s, 0.5), "p90_us": pct(s, 0.9), "p99_us": pct(s, 0.99),
            "p999_us": pct(s, 0.999), "max_us": s[-1] / 1000 if s else float("nan")}


async def open_store(backend: str, url: str | None, key_prefix: str):
    """The gateway's own factory (`egressgate.state.open_state`); on a tree that has the backend classes but
    not the factory yet, the class itself (started as the factory would). A clear error, never a stand-in,
    when this tree has no such backend."""
    try:
        from egressgate.config import StateConfig
        from egressgate.state import open_state
    except ImportError:
        open_state = None
    if open_state is not None:
        kwargs = {"backend": backend, "key_prefix": key_prefix}
        if url:
            kwargs["url"] = url
        store = open_state(StateConfig(**kwargs))
        return await store if inspect.isawaitable(store) else store
    if backend == "memory":
        from egressgate.state.memory import MemoryState

        return MemoryState()
    try:
        from egressgate.state.redis import RedisState
    except ImportError as exc:
        raise RuntimeError(f"this tree has no Redis state backend: {exc}") from None
    store = RedisState(url, key_prefix=key_prefix)
    if hasattr(store, "start"):
        await store.start()
    return store


async def measure(args: argparse.Namespace) -> dict:
    from egressgate.state.base import SandboxRecord, hash_token

    prefix = args.key_prefix or f"egB-budget-{secrets.token_hex(3)}:"
    store = await open_store(args.backend, args.url, prefix)
    if not hasattr(store, "reserve_out"):
        await store.close()
        raise RuntimeError(f"{type(store).__name__} has no reserve_out (the issue-12 state contract)")
    sid = "sbx-budget-" + secrets.token_hex(4)
    await store.admit(SandboxRecord(id=sid, token_hash=hash_token(secrets.token_hex(16)), policy_name="bench",
                                    admitted_at=time.time()))
    reserve: list[int] = []
    settle: list[int] = []
    clock = time.perf_counter_ns
    want = args.want

    async def one() -> None:
        t0 = clock()
        got = await store.reserve_out(sid, want, want, LIMIT)
        t1 = clock()
        if got != want:
            raise RuntimeError(f"reserve_out granted {got} of {want} under a limit it cannot reach")
        await store.settle_out(sid, want, 0)
        settle.append(clock() - t1)
        reserve.append(t1 - t0)

    try:
        for _ in range(min(200, args.n)):  # warm: connection pool, script load (SCRIPT LOAD / EVALSHA)
            await store.reserve_out(sid, want, want, LIMIT)
            await store.settle_out(sid, want, 0)
        t_start = time.monotonic()
        cpu0 = time.process_time()
        if args.duration:
            end = t_start + args.duration
            while time.monotonic() < end:
                await one()
                await asyncio.sleep(args.pace_ms / 1000)
        else:
            per = [args.n // args.concurrency + (1 if i < args.n % args.concurrency else 0)
                   for i in range(args.concurrency)]

            async def task(k: int) -> None:
                for _ in range(k):
                    await one()

            await asyncio.gather(*(task(k) for k in per))
        wall = time.monotonic() - t_start
        cpu = time.process_time() - cpu0
    finally:
        await store.close()
    return {"backend": args.backend, "store": type(store).__name__, "concurrency": args.concurrency,
            "paced_ms": args.pace_ms if args.duration else None, "wall_s": round(wall, 2),
            # this process's CPU per reserve_out + settle_out pair: what the budget path costs a gateway's core
            "cpu_us_per_pair": round(1e6 * cpu / max(1, len(reserve)), 1),
            "pairs_per_s": round(len(reserve) / wall) if wall else None,
            "reserve_out": stats(reserve), "settle_out": stats(settle)}


def run(args: argparse.Namespace) -> dict:
    if args.backend == "redis" and not args.url:
        from loadtests import state_procs
        from loadtests.procs import free_port

        with tempfile.TemporaryDirectory(prefix="egB-budget-") as d:
            port = free_port()
            redis = state_procs.start_redis(Path(d), port)
            try:
                args.url = redis.info["url"]
                out = asyncio.run(measure(args))
                out["redis_server"] = state_procs.redis_stats((), port)["latency_usec"]
                out["redis_version"] = redis.info["version"]
                return out
            finally:
                redis.stop()
    return asyncio.run(measure(args))


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["redis", "memory"], default="redis")
    ap.add_argument("--url", help="redis://127.0.0.1:PORT/0 of a Redis you started (default: start one)")
    ap.add_argument("--key-prefix")
    ap.add_argument("-n", type=int, default=20000, help="calls (sequential/concurrent modes)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--want", type=int, default=1024, help="bytes reserved per call (a 1 KiB request)")
    ap.add_argument("--duration", type=float, default=0.0, help="paced mode: probe for this many seconds")
    ap.add_argument("--pace-ms", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def main() -> None:
    args = parse(sys.argv[1:])
    try:
        out = run(args)
    except RuntimeError as exc:
        out = {"error": " ".join(str(exc).split())[:400]}
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        if "error" in out:
            print("not available:", out["error"])
            sys.exit(1)
        r = out["reserve_out"]
        print(f"{out['store']} reserve_out x{r['calls']} c={out['concurrency']}: p50 {r['p50_us']:.1f} us  "
              f"p99 {r['p99_us']:.1f} us  p99.9 {r['p999_us']:.1f} us  max {r['max_us']:.0f} us; "
              f"{out['cpu_us_per_pair']} us CPU per reserve+settle pair, {out['pairs_per_s']} pairs/s")
    sys.exit(1 if "error" in out else 0)


if __name__ == "__main__":
    main()
