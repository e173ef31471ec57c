"""The index while a writer appends: lines arriving in pieces (a partial last line at any byte), one index
writer at a time (a second one waits or is refused), the follower thread catching up with a real sink, and
the deny statistics the console charts."""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest

from egressgate.audit.index import AuditIndex, IndexBusy, IndexFollower
from tests.audit_index.chaingen import HOSTS, T0, lines, request_hash
from tests.support.audit_events import http_event


def test_concurrent_writer_appending_in_pieces_while_indexing(tmp_path, index):
    path = tmp_path / "audit.jsonl"
    n = 3000
    data = b"".join(lines(n, realistic=False))
    done = threading.Event()
    passes = threading.Semaphore(0)  # one piece written while each indexing pass runs

    def writer() -> None:
        rnd = random.Random(7)
        with open(path, "ab", buffering=0) as fh:
            pos = 0
            while pos < len(data):
                passes.acquire(timeout=10)
                step = rnd.randint(1, 40_000)  # cuts lines anywhere, often mid-record
                fh.write(data[pos : pos + step])
                pos += step
        done.set()

    path.touch()
    t = threading.Thread(target=writer)
    t.start()
    runs, partial_seen = 0, False
    while not done.is_set():
        passes.release()
        stats = index.add_files([path])
        assert stats.rebuilt == [] and stats.broken == [], stats
        partial_seen |= stats.partial_bytes > 0
        runs += 1
    t.join()
    final = index.add_files([path])
    assert final.rebuilt == [] and final.broken == []
    hits = index.find(limit=10_000)
    assert len(hits) == n and runs > 1
    assert sorted(h.line for h in hits) == list(range(1, n + 1))
    assert all(h.verified for h in hits)
    for i in (1, 1234, n - 1):
        (hit,) = index.find(request_hash=request_hash(i))
        assert hit.chain_index == i and index.record_line(hit) + b"\n" in data
    assert partial_seen, "control: some pass saw a partial last line"


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_one_writer_at_a_time(tmp_path, index):
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b"".join(lines(20, realistic=False)))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, f"{index.db_path}.lock"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(IndexBusy, match="another process is writing"):
            index.add_files([path], wait=False)
        assert index.find(limit=100) == []  # readers are never blocked
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert index.add_files([path], wait=False).added == 20  # control: free again


async def test_follower_keeps_up_with_a_real_sink(make_sink, index):
    sink = await make_sink()
    follower = IndexFollower(AuditIndex(index.db_path), lambda: [sink.path], interval_s=0.05).start()
    try:
        for i in range(5):
            await sink.write(http_event(i, request_id=f"live-{i}"))
        assert await follower.caught_up(timeout=10)
        assert {h.request_id for h in index.find(kind="http_request")} == {f"live-{i}" for i in range(5)}
        await sink.write(http_event(9, request_id="late", request_hash="sha256:" + "9" * 64))
        assert await follower.caught_up(timeout=10)
        (hit,) = index.find(request_hash="9" * 64)
        assert hit.request_id == "late" and hit.verified
        assert follower.last_error is None
    finally:
        follower.stop()
    assert not follower.catch_up(timeout=0.2)  # stopped: it says so instead of hanging


def test_deny_stats_by_reason_and_host(tmp_path, index):
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b"".join(lines(1000, realistic=False, deny_every=10)))
    index.add_files([path])
    # records 1..999 are 1 ms apart from T0; denies are i % 10 == 0 (99 of them), host HOSTS[i % 5]
    stats = index.stats(since_ns=T0, until_ns=T0 + 1_000_000_000, bucket_s=1)
    assert len(stats.buckets) == 1 and stats.buckets[0]["by_reason"] == {"no_rule_matched": 99}
    assert stats.top_denied_hosts == [{"host": HOSTS[0], "count": 99}]  # i % 10 == 0 -> i % 5 == 0
    half = index.stats(since_ns=T0, until_ns=T0 + 500_000_000, bucket_s=1)
    assert half.buckets[0]["by_reason"] == {"no_rule_matched": 49}  # 10..490
    wide = index.stats(since_ns=T0 - 2_000_000_000, until_ns=T0 + 2_000_000_000, bucket_s=1)
    assert [b["by_reason"] for b in wide.buckets] == [{}, {}, {"no_rule_matched": 99}, {}]
    with pytest.raises(ValueError):
        index.stats(since_ns=T0, until_ns=T0 + 10**18, bucket_s=1)  # a million buckets: refused
