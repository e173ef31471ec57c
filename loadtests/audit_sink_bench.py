"""Records per second the audit file sink sustains with concurrent writers (issue 6, "Benchmark").

Each writer awaits `sink.write(event)` in a loop (as a request handler does: durable before it proceeds),
so the figure includes chaining, encoding, signing checkpoints, the write and (with --fsync) fsync.

    .venv/bin/python -m loadtests.audit_sink_bench --concurrency 1 32 256 --seconds 5 [--fsync]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from egressgate.audit.event import AuditEvent
from egressgate.audit.filesink import FileSink
from egressgate.audit.signer import LocalEd25519Signer
from tests.support.audit_events import http_event


def event(i: int) -> AuditEvent:
    """The trail tests' realistic allowed HTTPS request (tests/support/audit_events.py), stamped now, with
    the request and body hashes a real record carries (they are part of what is encoded and chained)."""
    return http_event(i, time_ns=time.time_ns(), request_id=f"req-{i}", sandbox_id="sbx-bench",
                      sandbox_labels={"team": "x"}, bytes_out=512, request_hash="sha256:" + "cd" * 32,
                      body_hash="sha256:" + "ef" * 32)


async def run(concurrency: int, seconds: float, fsync: bool, directory: Path) -> dict:
    path = directory / f"bench-c{concurrency}-{'fsync' if fsync else 'nofsync'}" / "audit.jsonl"
    sink = await FileSink(path, LocalEd25519Signer.generate(), fsync=fsync, max_bytes=256 * 1024 * 1024).start()
    latencies: list[float] = []
    count = 0
    deadline = time.perf_counter() + seconds

    async def writer(w: int) -> None:
        nonlocal count
        i = 0
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            await sink.write(event(w * 10_000_000 + i))
            latencies.append(time.perf_counter() - t)
            count += 1
            i += 1

    start = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - start
    batches = sink.batches_written
    await sink.close()
    lat = sorted(latencies)
    return {
        "concurrency": concurrency,
        "fsync": fsync,
        "records_per_s": count / elapsed,
        "p50_ms": statistics.median(lat) * 1000,
        "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1000,
        "records_per_flush": count / max(batches, 1),
        # over every file: at these rates the sink rotates (max_bytes) during the run
        "bytes_per_record": sum(f.stat().st_size for f in path.parent.glob("audit*.jsonl")) / max(count, 1),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--fsync", action="store_true", help="also run with fsync after every batch")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        print(f"{'conc':>5} {'fsync':>5} {'records/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'rec/flush':>9} {'B/rec':>6}")
        for fsync in [False, True] if args.fsync else [False]:
            for c in args.concurrency:
                r = await run(c, args.seconds, fsync, Path(d))
                print(
                    f"{r['concurrency']:>5} {'yes' if r['fsync'] else 'no':>5} {r['records_per_s']:>10.0f} "
                    f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['records_per_flush']:>9.1f} "
                    f"{r['bytes_per_record']:>6.0f}"
                )


if __name__ == "__main__":
    asyncio.run(main())
