"""Which files the console's index and replay read: every chain of the gateway's trail in chain order
(rotated files by time, the live file last), every worker's chain, never the retry spool or the index."""

from __future__ import annotations

from egressgate.admin.ui.audit_api import index_path, trail_files


def test_trail_files_are_every_chain_in_order_and_nothing_else(tmp_path):
    names = ["audit.jsonl", "audit.20261130T010203_000001Z.jsonl", "audit.20261129T010203_000001Z.jsonl",
             "audit.20261129T010203_000001Z-1.jsonl", "audit.w1.jsonl", "audit.w1.20261130T000000_000000Z.jsonl",
             "audit-retry.jsonl", "audit-retry.w1.jsonl", "audit.jsonl.index.sqlite", "audit.jsonl.index.sqlite-wal",
             "audit-signing.key", "other.jsonl", "audit.wx.jsonl", "audit.jsonl.bak"]
    for name in names:
        (tmp_path / name).write_text("")
    (tmp_path / "audit.w2.jsonl").mkdir()  # not a file
    expected = ["audit.20261129T010203_000001Z.jsonl", "audit.20261129T010203_000001Z-1.jsonl",
                "audit.20261130T010203_000001Z.jsonl", "audit.jsonl",
                "audit.w1.20261130T000000_000000Z.jsonl", "audit.w1.jsonl"]
    for live in ("audit.jsonl", "audit.w1.jsonl"):  # the supervisor's name or a worker's: the same trail
        got = [p.name for p in trail_files(tmp_path / live)]
        assert got == expected  # per chain: rotated files oldest first (a same-stamp "-1" after), live last
        assert index_path(tmp_path / live) == tmp_path / "audit.jsonl.index.sqlite"  # `audit find`'s name
    assert trail_files(tmp_path / "missing-dir" / "audit.jsonl") == []
