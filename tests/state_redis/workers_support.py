"""What the shared-state tests of `run --workers N` share: a gateway with N workers on a real Redis, its
workers' pids and audit files, and a sandbox's requests on fresh connections."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from tests.support.gwworld import Gateway, Sandbox, World, start_gateway
from tests.support.launcher import audit_records
from tests.support.redis import RedisServer


def state(redis: RedisServer, prefix: str | None = None) -> dict:
    return {"state": {"backend": "redis", "url": redis.url, "key_prefix": prefix or redis.prefix()}}


def start_workers(world: World, tmp: Path, redis: RedisServer, prefix: str | None = None) -> Gateway:
    """`egressgate run --workers 2` on `redis` (the world's policies, upstreams and DNS): the unmodified console
    script, forked from the test fork server (tests/support/zygote.py) as every other gateway start."""
    return start_gateway(world, tmp, state(redis, prefix), args=["--workers", "2"])


def holder(path: Path, pids: set[int]) -> int | None:
    """Which of `pids` has `path` open (a worker's audit file has one writer)."""
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            if any(os.path.realpath(fd_dir / fd) == str(path.resolve()) for fd in os.listdir(fd_dir)):
                return pid
        except FileNotFoundError:
            continue
    return None


def worker_records(var: Path) -> dict[int, list[dict]]:
    """Every record of every worker's audit files (rotated and live), by worker slot."""
    out: dict[int, list[dict]] = {}
    for path in sorted(var.glob("audit.w*.jsonl")):
        slot = int(path.name.split(".")[1][1:])
        out.setdefault(slot, []).extend(audit_records(path))
    return out


def slots_with(var: Path, **match: str) -> set[int]:
    """The worker slots whose audit files hold a record with these attribute values."""
    return {slot for slot, recs in worker_records(var).items()
            if any(all(str(r.get(k)) == v for k, v in match.items()) for r in recs)}


def get_fresh(sbx: Sandbox, path: str = "/echo", host: str = "api.test", scheme: str = "https") -> httpx.Response:
    """One GET through the proxy on a NEW connection (the kernel picks the worker per connection).
    `scheme="http"`: a plain request, whose deny (407, 403, ...) is a response with the JSON body (an
    https request is refused on its CONNECT, which httpx raises as ProxyError)."""
    with sbx.client() as c:
        return c.get(sbx.url(host, path, scheme=scheme))
