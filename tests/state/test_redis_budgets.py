"""Budgets on Redis across real processes: exact under concurrency, and the leases of a worker killed
with -9 are forfeited (they stay spent) exactly once, even with two reconcilers at the same moment."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from tests.state.helpers import record, redis_store
from tests.support.launcher import stop_process
from tests.support.redis import RedisServer

WORKER = r"""
import asyncio, json, sys
from egressgate.state.redis import RedisState

async def main(url, prefix, mode, n, limit):
    store = RedisState(url, prefix, heartbeat_ttl=float(sys.argv[6]))
    await store.start()
    if mode == "reserve":
        grants = await asyncio.gather(*(store.reserve_out("sbx", 7, 1, limit) for _ in range(n)))
        print(json.dumps({"granted": sum(grants), "worker": store.worker_id}), flush=True)
    elif mode == "rule":
        ok = await asyncio.gather(*(store.record_request("sbx", "a.example", "r1", 1, requests_max=limit)
                                    for _ in range(n)))
        print(json.dumps({"allowed": sum(ok), "worker": store.worker_id}), flush=True)
    elif mode == "hold":
        got = await store.reserve_out("sbx", n, n, None)
        print(json.dumps({"granted": got, "worker": store.worker_id}), flush=True)
        await asyncio.sleep(3600)  # killed with -9 while holding the lease
    await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
"""


def _spawn(server: RedisServer, prefix: str, mode: str, n: int, limit: int, ttl: float = 15.0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", WORKER, server.url, prefix, mode, str(n), str(limit), str(ttl)],
                            stdout=subprocess.PIPE, env=env, text=True)


def _results(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


async def test_byte_budget_is_exact_across_processes(redis_server: RedisServer):
    prefix = redis_server.prefix()
    store = await redis_store(redis_server, prefix)
    try:
        await store.admit(record())
        procs = [_spawn(redis_server, prefix, "reserve", 300, 2000) for _ in range(3)]
        results = await asyncio.to_thread(_results, procs)
        assert sum(r["granted"] for r in results) == 2000  # 3 x 300 x 7 = 6300 asked for
        assert (await store.snapshot("sbx")).bytes_out == 2000
    finally:
        await store.close()


async def test_rule_request_budget_is_exact_across_processes(redis_server: RedisServer):
    prefix = redis_server.prefix()
    store = await redis_store(redis_server, prefix)
    try:
        await store.admit(record())
        procs = [_spawn(redis_server, prefix, "rule", 100, 37) for _ in range(3)]
        results = await asyncio.to_thread(_results, procs)
        assert sum(r["allowed"] for r in results) == 37
        assert (await store.snapshot("sbx")).rule_usage["r1"].requests == 37
    finally:
        await store.close()


async def test_killed_workers_leases_are_forfeited_exactly_once(redis_server: RedisServer):
    prefix = redis_server.prefix()
    b, c = await redis_store(redis_server, prefix), await redis_store(redis_server, prefix)
    proc = _spawn(redis_server, prefix, "hold", 500, 0, ttl=0.5)
    try:
        await b.admit(record())
        line = await asyncio.to_thread(proc.stdout.readline)
        held = json.loads(line)
        assert held["granted"] == 500
        assert await b.reconcile(time.time()) == []  # positive control: a live worker keeps its lease
        assert await b.reserve_out("sbx", 10, 10, None) == 10  # b's own live lease must survive too
        proc.kill()
        proc.wait(5)
        await asyncio.sleep(0.7)  # its heartbeat key expires (TTL 0.5 s on Redis's clock)
        rounds = await asyncio.gather(*(s.reconcile(time.time()) for s in (b, c, b, c)))
        forfeited = [item for found in rounds for item in found]
        assert forfeited == [(held["worker"], "sbx", 500)]
        assert await c.reconcile(time.time()) == []
        assert (await b.snapshot("sbx")).bytes_out == 510  # forfeited bytes stay spent
        await b.settle_out("sbx", spent=0, unused=10)  # b's lease was untouched
        assert (await b.snapshot("sbx")).bytes_out == 500
    finally:
        stop_process(proc, timeout=5)
        await b.close()
        await c.close()
