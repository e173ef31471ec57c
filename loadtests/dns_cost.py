"""Where a denied DNS query's CPU goes, in process (no sockets): the resolver with different audit sinks.

`Resolver.handle` for one denied name, 32 concurrent tasks, MemoryState, CPU time per query (best of 3):
- `mem`: events dropped (the resolver's own work, including building the AuditEvent);
- `build`: + `record_from_event` (the OTLP attribute set);
- `encode`: + `ChainWriter.append` (canonical JSON line + SHA-256 chain);
- `file`: the real FileSink (group commit, futures, write) - what the server pays per query before sockets.
The difference between consecutive rows is the cost of that step. For before/after, run it with
`PYTHONPATH=DIR` of another source tree.

    .venv/bin/python loadtests/dns_cost.py [--n 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dns_bench import POLICY, SANDBOX_SOURCE, query_packet

from egressgate.audit.chain import ChainWriter
from egressgate.audit.filesink import FileSink
from egressgate.audit.record import record_from_event
from egressgate.audit.signer import LocalEd25519Signer
from egressgate.dns.config import DnsConfig
from egressgate.dns.resolver import Resolver
from egressgate.policy.loader import parse_policy
from egressgate.state.base import SandboxRecord, hash_token
from egressgate.state.memory import MemoryState


class _Discard:
    async def write(self, event) -> None:
        return None

    def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        return None


class _Build(_Discard):
    async def write(self, event) -> None:
        record_from_event(event)


class _Encode(_Discard):
    def __init__(self) -> None:
        self.chain = ChainWriter()

    async def write(self, event) -> None:
        self.chain.append(record_from_event(event))


async def measure(kind: str, n: int, directory: str) -> float:
    state = MemoryState()
    await state.admit(SandboxRecord(id="sbx-bench", token_hash=hash_token("t"), policy_name="bench",
                                    admitted_at=time.time(), addresses=(SANDBOX_SOURCE,)))
    if kind == "file":
        sink = await FileSink(Path(directory) / kind / "audit.jsonl", LocalEd25519Signer.generate()).start()
    else:
        sink = {"mem": _Discard, "build": _Build, "encode": _Encode}[kind]()
    resolver = Resolver({"bench": parse_policy(POLICY, "<bench>")}.get, state, sink,
                        DnsConfig(upstreams=(("127.0.0.1", 9),)))  # never contacted: the name is denied
    packet = query_packet("denied.example.org")
    per_task = n // 32

    async def worker() -> None:
        for _ in range(per_task):
            answer = await resolver.handle(packet, SANDBOX_SOURCE, True)
            assert answer is not None and answer[3] & 0xF == 3  # NXDOMAIN
    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(32)))
    cpu = time.process_time() - start
    await sink.close()
    return cpu / (per_task * 32) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        prev = 0.0
        for kind in ("mem", "build", "encode", "file"):
            us = min(asyncio.run(measure(kind, args.n, d)) for _ in range(3))
            print(f"{kind:7s} {us:6.1f} us CPU/query   (+{us - prev:5.1f})")
            prev = us


if __name__ == "__main__":
    main()
