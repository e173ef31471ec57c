"""Credential broker cost: cold mints against a real OpenBao, cached issues, scrubbing throughput.

Run: `.venv/bin/python -m loadtests.broker_bench [--n 200]`. Starts its own `bao server -dev` on a free
loopback port (tests/support/bao.py), logs in by AppRole like the gateway does, then measures:
- cold mint latency (cache miss: a new sandbox id each time) for a transit-signed JWT, a KV v2 static
  read and an identity OIDC token — one Vault round trip each, through hvac in a worker thread;
- the same for the local backend (in-process Ed25519);
- cached issue latency (cache hit), timed in batches so timer overhead does not dominate;
- a burst of 50 concurrent misses for one key (single-flight: one backend call);
- streaming scrubber throughput on a 1 MiB body in 16 KiB chunks (2 secrets, basic username);
- the CPU the pure credential steps add to one request (phantom check, injection, header + body scrub).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

from pydantic import TypeAdapter

from egressgate.broker.broker import Broker
from egressgate.broker.config import BrokerConfig, Capability
from egressgate.broker.credential import Credential
from egressgate.broker.decompress import scrubbing_stream
from egressgate.broker.inject import find_phantoms, inject
from egressgate.broker.redact import Scrubber, SecretSpec, cached_scrubber
from tests.support.bao import BaoServer

CAP = TypeAdapter(Capability)
JWT = CAP.validate_python({"type": "jwt", "ttl_seconds": 300})
KV = CAP.validate_python({"type": "static", "source": {"vault": {"path": "egressgate/openai", "field": "api_key"}}})
OIDC = CAP.validate_python({"type": "vault_oidc", "role": "sbx-api"})


def ms(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": round(statistics.median(s) * 1e3, 3),
        "p90_ms": round(s[int(len(s) * 0.9) - 1] * 1e3, 3),
        "n": len(s),
    }


async def cold(broker: Broker, name: str, cap, n: int) -> dict[str, float]:
    now = time.time()
    await broker.issue(name, cap, "warmup", "api.example.test", now)  # transit key info, connection
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        await broker.issue(name, cap, f"sbx-{i}", "api.example.test", now)
        out.append(time.perf_counter() - t0)
    return ms(out)


async def cached(broker: Broker, name: str, cap, batches: int = 50, per: int = 200) -> dict[str, float]:
    now = time.time()
    await broker.issue(name, cap, "hot", "api.example.test", now)
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per):
            await broker.issue(name, cap, "hot", "api.example.test", now)
        out.append((time.perf_counter() - t0) / per)
    out.sort()
    return {
        "p50_us": round(statistics.median(out) * 1e6, 2),
        "p90_us": round(out[int(len(out) * 0.9) - 1] * 1e6, 2),
        "n": batches * per,
    }


async def burst(broker: Broker, cap) -> dict[str, float]:
    calls0 = broker.backend.calls
    t0 = time.perf_counter()
    await asyncio.gather(*(broker.issue("burst", cap, "one", "api.example.test", time.time()) for _ in range(50)))
    return {
        "concurrent": 50,
        "backend_calls": broker.backend.calls - calls0,
        "wall_ms": round((time.perf_counter() - t0) * 1e3, 3),
    }


def scrub_throughput() -> dict[str, float]:
    s = Scrubber([SecretSpec("sk-live-0123456789abcdefghijklmnop", "svc"), "eyJhbGciOiJFZERTQSJ9.payload.sig"])
    body = os.urandom(1 << 20)
    chunks = [body[i : i + 16384] for i in range(0, len(body), 16384)]
    runs = []
    for _ in range(5):
        stream = s.stream()
        t0 = time.perf_counter()
        for c in chunks:
            stream(c)
        stream(b"")
        runs.append(time.perf_counter() - t0)
    return {"MiB_per_s": round(1 / statistics.median(runs), 1), "patterns": len(s.patterns)}


def per_request_overhead(n: int = 2000) -> dict[str, float]:
    """CPU the pure credential steps add to one request: phantom check, injection, response header
    scrub and a 2 KiB body through the decode+scrub stream (Scrubber from the per-credential cache)."""
    cred = Credential("openai", "sk-live-0123456789abcdefghijklmnop", "k", 0.0, 300.0)
    headers = [
        ("Host", "api.example.test"),
        ("User-Agent", "python-httpx/0.27"),
        ("Accept", "*/*"),
        ("Content-Type", "application/json"),
        ("Authorization", "Bearer sandbox"),
    ]
    resp_headers = [
        ("Content-Type", "application/json"),
        ("Date", "Sun, 29 Nov 2026 14:00:00 GMT"),
        ("Server", "upstream"),
        ("Set-Cookie", "a=b; HttpOnly"),
        ("Cache-Control", "no-store"),
    ]
    body = b'{"choices": [{"text": "' + b"lorem ipsum " * 170 + b'"}]}'
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        find_phantoms(headers, [], b'{"model": "x"}', path="/v1/chat/completions")
        inject(KV, cred, headers, [])
        scrubber = cached_scrubber(SecretSpec(cred.value))
        scrubber.scrub_headers(resp_headers)
        stream = scrubbing_stream(None, scrubber)
        stream(body[:1024])
        stream(body[1024:])
        stream(b"")
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return {"p50_us": round(statistics.median(samples) * 1e6, 1), "p90_us": round(samples[int(n * 0.9)] * 1e6, 1)}


async def main(n: int) -> dict:
    server = BaoServer().start().configure()
    results: dict = {}
    try:
        cfg = BrokerConfig(backend="vault", vault_addr=server.addr, role_id=server.role_id, secret_id=server.secret_id)
        vault = Broker.from_config(cfg)
        await vault.start()
        results["vault_cold_jwt_transit"] = await cold(vault, "jwt", JWT, n)
        results["vault_cold_kv_static"] = await cold(vault, "kv", KV, n)
        results["vault_cold_oidc"] = await cold(vault, "oidc", OIDC, max(n // 2, 10))
        results["cached_issue"] = await cached(vault, "jwt", JWT)
        results["burst_single_flight"] = await burst(vault, JWT)
        await vault.aclose()
    finally:
        server.stop()
    with tempfile.TemporaryDirectory() as d:
        local = Broker.from_config(BrokerConfig(local_key_dir=d))
        await local.start()
        results["local_cold_jwt"] = await cold(local, "jwt", JWT, n)
        await local.aclose()
    results["scrubber_stream_1MiB"] = scrub_throughput()
    results["pure_per_request_overhead"] = per_request_overhead()
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.n)), indent=2))
