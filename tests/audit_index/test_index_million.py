"""1,000,000 records: the index finds a request by its hash (the right record, verified, read back from the
JSONL), misses what is not there, and a second run reads only what was appended. Correctness only: the
timing goals are measured by loadtests/index_bench.py (RESULTS.md). The chain is generated in-process
(tests/audit_index/chaingen.py), not through a gateway, so the test stays within its time budget."""

from __future__ import annotations

import random

from egressgate.audit.index import AuditIndex
from tests.audit_index.chaingen import lines, request_hash, request_id, write_chain

N = 1_000_000


def test_find_by_hash_among_a_million_records(tmp_path):
    path = write_chain(tmp_path / "audit.jsonl", N, realistic=False)
    index = AuditIndex(tmp_path / "audit.jsonl.index.sqlite", workers=2)
    try:
        stats = index.add_files([path])
        assert stats.added == N and stats.broken == [] and stats.partial_bytes == 0
        rnd = random.Random(1_000_000)
        for i in [1, N // 2, N - 1, *rnd.sample(range(1, N), 20)]:
            hits = index.find(request_hash=request_hash(i))
            assert len(hits) == 1, (i, hits)
            (hit,) = hits
            assert (hit.chain_index, hit.line, hit.request_id, hit.verified) == (i, i + 1, request_id(i), True)
            assert request_id(i).encode() in index.record_line(hit)  # read back from the file, re-checked
        assert index.find(request_hash=request_hash(N)) == []  # control: a hash that is not in the trail
        assert len(index.find(decision="deny", limit=10_000)) == 10_000  # every 10th record: 99,999 of them

        # the chain continues: a second run reads the 100 new lines only, and checks their link
        last = index.find(request_hash=request_hash(N - 1))[0].record_hash
        with open(path, "ab") as fh:
            fh.writelines(lines(100, start=N, prev=last, realistic=False))
        again = index.add_files([path])
        assert again.added == 100 and again.rebuilt == [] and again.broken == []
        (new,) = index.find(request_hash=request_hash(N + 50))
        assert new.verified and new.chain_index == N + 50
    finally:
        index.close()
