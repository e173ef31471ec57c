"""Audit index (issue 14): build rate, and find by request hash among N records.

Goals: index build >= 50,000 records/s; find by request hash among 1,000,000 records <= 50 ms.

Generates a valid chain of N gateway-shaped HTTPS decision records (~2.4 kB each, the shape FileSink writes for
a proxied request, labels included; tests/audit_index/chaingen.py: one template made by the real encoder, the
chain hashes computed as chain.py defines them), then, `--runs` times, builds a fresh index of the file
(`AuditIndex.add_files`, as `egressgate audit index` does) and times `--finds` look-ups of random request
hashes, each followed by `record()` (the line read back from the JSONL and re-checked), as `audit find` and
the console do. Prints the median, min and max of every figure (wall clock; CPU seconds of this process too,
since the machine may be shared), and the build rate with 1 worker and with `--workers`.

    PYTHONPATH=$PWD .venv/bin/python loadtests/index_bench.py [--records 1000000] [--runs 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from egressgate.audit.index import AuditIndex
from tests.audit_index.chaingen import request_hash, write_chain


def _fmt(values: list[float], unit: str, scale: float = 1.0, digits: int = 0) -> str:
    v = sorted(x * scale for x in values)
    return (f"median {statistics.median(v):,.{digits}f} {unit} (min {v[0]:,.{digits}f}, max {v[-1]:,.{digits}f}, "
            f"n={len(v)})")


def bench(records: int, runs: int, finds: int, workers: list[int], realistic: bool, keep: Path | None) -> None:
    work = Path(tempfile.mkdtemp(prefix="e14i-bench-", dir=keep))
    try:
        audit = work / "audit.jsonl"
        t = time.perf_counter()
        write_chain(audit, records, realistic=realistic)
        size = audit.stat().st_size
        print(f"generated {records:,} records, {size / 1e6:,.0f} MB ({size / records:,.0f} B/record) in "
              f"{time.perf_counter() - t:.1f}s; cpu count {os.cpu_count()}, load {os.getloadavg()[0]:.2f}")
        rnd = random.Random(14)
        for w in workers:
            rates, cpu_rates, find_ms, record_ms = [], [], [], []
            for run in range(runs):
                db = work / f"index-{w}-{run}.sqlite"
                index = AuditIndex(db, workers=w)
                wall, cpu = time.perf_counter(), time.process_time()
                stats = index.add_files([audit])
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                assert stats.added == records and not stats.broken, stats
                rates.append(records / wall)
                cpu_rates.append(records / cpu)
                for _ in range(finds):
                    i = rnd.randrange(1, records)
                    t = time.perf_counter()
                    (hit,) = index.find(request_hash=request_hash(i))
                    find_ms.append((time.perf_counter() - t) * 1e3)
                    t = time.perf_counter()
                    index.record(hit)
                    record_ms.append((time.perf_counter() - t) * 1e3)
                    assert hit.chain_index == i and hit.verified
                index.close()
                for suffix in ("", "-wal", "-shm", ".lock"):
                    Path(f"{db}{suffix}").unlink(missing_ok=True)
            print(f"workers={w}: build {_fmt(rates, 'records/s')}")
            print(f"           build, per CPU-second of the main process: {_fmt(cpu_rates, 'records/s')}"
                  + (" (the parse runs in worker processes)" if w > 1 else ""))
            print(f"           find by request hash among {records:,}: {_fmt(find_ms, 'ms', digits=3)}")
            print(f"           record(hit) read back + re-check: {_fmt(record_ms, 'ms', digits=3)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--finds", type=int, default=200)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--small", action="store_true", help="~1.3 kB minimal decision records instead of ~2.4 kB")
    ap.add_argument("--dir", type=Path, default=None, help="where the trail and index go (default: $TMPDIR)")
    args = ap.parse_args()
    bench(args.records, args.runs, args.finds, args.workers, not args.small, args.dir)


if __name__ == "__main__":
    main()
