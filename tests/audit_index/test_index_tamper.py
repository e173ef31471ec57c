"""The index is never trusted over the JSONL: an edited, truncated or replaced file is re-indexed from its
bytes (and the chain break reported), a record read back is re-checked, a partial last line waits, a rotated
file keeps its rows. Each adversarial test has its control: the same steps without the tampering."""

from __future__ import annotations

import os

import pytest

from egressgate.audit.filewatch import chain_name
from egressgate.audit.index import IndexStale
from tests.audit.forge import rewrite_chain
from tests.support.audit_events import http_event

RH = "sha256:" + "d2" * 32


async def _file(make_sink, n: int = 8, close: bool = True):
    sink = await make_sink()
    for i in range(n):
        await sink.write(http_event(i, request_id=f"r{i}", request_hash=RH if i == 6 else None))
    if close:
        await sink.close()
    return sink


def _edit_line(path, number: int, old: bytes, new: bytes) -> None:
    lines = path.read_bytes().split(b"\n")
    assert old in lines[number - 1]
    lines[number - 1] = lines[number - 1].replace(old, new, 1)
    path.write_bytes(b"\n".join(lines))  # in place: same inode


async def test_edited_record_changing_length_is_reindexed_and_unverified_from_there(make_sink, index):
    sink = await _file(make_sink)
    assert index.add_files([sink.path]).rebuilt == []
    assert all(h.verified for h in index.find(limit=100))  # control: a clean file verifies
    _edit_line(sink.path, 4, b'"server.address","value":{"stringValue":"api.openai.com"',
               b'"server.address","value":{"stringValue":"api.openai.com.evil.example"')  # record r2 (line 4)
    stats = index.add_files([sink.path])
    assert _why(stats, sink.path) == ["record at line 10 changed"], stats.rebuilt
    assert stats.broken == [f"{sink.path}: line 4 (seq 3): record edited (its content does not match its chain hash)"]
    hits = sorted(index.find(limit=100), key=lambda h: h.line)
    assert [h.verified for h in hits] == [True] * 3 + [False] * (len(hits) - 3)
    assert hits[3].host == "api.openai.com.evil.example"  # the index shows the bytes as they are now
    (hit,) = index.find(request_hash=RH)
    assert not hit.verified and index.record(hit)  # readable, and flagged


async def test_same_length_edit_in_the_middle_is_caught_when_read_back_and_by_verify(make_sink, index):
    sink = await _file(make_sink)
    index.add_files([sink.path])
    (hit,) = index.find(request_hash=RH)
    assert index.record_line(hit)  # control: the unedited record reads back
    _edit_line(sink.path, hit.line, b'"allow"', b'"ALLOW"')
    with pytest.raises(IndexStale, match="changed since it was indexed"):
        index.record_line(hit)
    stats = index.add_files([sink.path])  # the read-back marked the file: rebuilt now
    assert _why(stats, sink.path) == [f"a record read back did not match the indexed bytes (line {hit.line} changed)"]
    assert stats.broken == [f"{sink.path}: line {hit.line} (seq {hit.chain_index}): record edited (its content does "
                            "not match its chain hash)"]
    (again,) = index.find(request_hash=RH)
    assert not again.verified and again.decision == "ALLOW"
    assert index.record(again)  # the new row matches the file as it is


async def test_verify_rereads_every_line(make_sink, index):
    sink = await _file(make_sink)
    index.add_files([sink.path])
    clean = index.verify()
    assert clean.ok and clean.files[0].records == 10 and clean.files[0].verified == 10  # control
    _edit_line(sink.path, 5, b'"allow"', b'"ALLOW"')
    report = index.verify()
    assert not report.ok
    (check,) = report.files
    assert check.rebuilt == "line 5 changed since it was indexed"
    assert check.broken is not None and check.broken.startswith("line 5 (seq 4): record edited")
    assert check.verified == 4


async def test_forged_chain_is_reindexed_but_only_signatures_can_tell(make_sink, index):
    """An attacker who re-hashes every later line produces a consistent chain: the index re-reads it (its
    rows follow the bytes, never the old ones) and `audit verify` (signatures) is what catches the forgery."""
    sink = await _file(make_sink)
    index.add_files([sink.path])
    rewrite_chain(sink.path, 3, "server.address", "forged.example")
    stats = index.add_files([sink.path])
    assert stats.rebuilt, "the last line's hash changed: the file must be re-read"
    assert [h.line for h in index.find(host="forged.example")] == [4]


async def test_truncated_file_is_reindexed(make_sink, index):
    sink = await _file(make_sink)
    index.add_files([sink.path])
    assert len(index.find(request_hash=RH)) == 1
    lines = sink.path.read_bytes().split(b"\n")
    with open(sink.path, "r+b") as fh:  # same inode, cut after line 5
        fh.truncate(sum(len(x) + 1 for x in lines[:5]))
    stats = index.add_files([sink.path])
    assert len(stats.rebuilt) == 1 and _why(stats, sink.path)[0].startswith("truncated (")
    assert index.find(request_hash=RH) == []  # line 8 is gone from the file: gone from the index
    assert len(index.find(limit=100)) == 5 and all(h.verified for h in index.find(limit=100))


def _why(stats, path) -> list[str]:
    """The reasons add_files gave for re-indexing (without the path, which may contain any word)."""
    return [r.removeprefix(f"{path}: ") for r in stats.rebuilt]


async def test_replaced_by_an_edited_copy_of_the_same_size(make_sink, index, tmp_path):
    """Same first line, same last line, same size: only the file's identity (inode) tells it was replaced."""
    sink = await _file(make_sink)
    index.add_files([sink.path])
    copy = tmp_path / "copy.jsonl"
    data = sink.path.read_bytes().split(b"\n")
    data[4] = data[4].replace(b'"allow"', b'"ALLOW"')
    copy.write_bytes(b"\n".join(data))
    os.replace(copy, sink.path)
    stats = index.add_files([sink.path])
    assert _why(stats, sink.path) == ["replaced (a different file now has this name)"]
    assert stats.broken and "line 5 (seq 4): record edited" in stats.broken[0]


async def test_replaced_file_with_the_same_name(make_sink, index, tmp_path):
    sink = await _file(make_sink)
    index.add_files([sink.path])
    other_dir = tmp_path / "other"
    other = await make_sink(other_dir / "audit.jsonl")
    await other.write(http_event(50, request_id="new-one"))
    await other.close()
    os.replace(other.path, sink.path)  # a different inode under the indexed name
    stats = index.add_files([sink.path])
    assert _why(stats, sink.path) == ["replaced (a different file now has this name)"]
    assert index.find(request_hash=RH) == []
    assert [h.request_id for h in index.find(request_id="new-one")] == ["new-one"]
    assert len(index.find(limit=100)) == 3


async def test_partial_last_line_waits_for_the_rest(make_sink, index):
    sink = await _file(make_sink)
    data = sink.path.read_bytes()
    cut = data.rfind(b"\n", 0, len(data) - 1) + 1 + 100  # 100 bytes into the last line
    sink.path.write_bytes(data[:cut])
    stats = index.add_files([sink.path])
    assert stats.partial_bytes == 100 and stats.added == 9 and stats.broken == []
    with open(sink.path, "ab") as fh:
        fh.write(data[cut:])
    again = index.add_files([sink.path])
    assert again.added == 1 and again.rebuilt == [] and again.broken == []
    assert all(h.verified for h in index.find(limit=100)) and len(index.find(limit=100)) == 10


async def test_rotated_file_keeps_its_rows(make_sink, index):
    sink = await make_sink(max_bytes=6000)
    for i in range(12):
        await sink.write(http_event(i, request_id=f"r{i}", request_hash=RH if i == 1 else None))
        if i == 2:
            index.add_files([sink.path])  # indexed while it is the live file
    await sink.close()
    files = sorted(p for p in sink.path.parent.iterdir() if p.suffix == ".jsonl" and chain_name(p) == sink.path.name)
    assert len(files) >= 2, "control: the sink rotated"
    stats = index.add_files(files)
    assert stats.renamed and stats.renamed[0].startswith(f"{sink.path} -> "), stats
    assert stats.rebuilt == []
    (hit,) = index.find(request_hash=RH)
    assert hit.file != str(sink.path) and index.record(hit)
    report = index.verify()
    assert report.ok, report
    assert sum(f.records for f in report.files) == sum(len(p.read_bytes().splitlines()) for p in files)


async def test_a_missing_link_between_rotated_files_is_reported(make_sink, index):
    sink = await make_sink(max_bytes=4000)
    for i in range(16):
        await sink.write(http_event(i))
    await sink.close()
    files = sorted(p for p in sink.path.parent.iterdir() if p.suffix == ".jsonl" and chain_name(p) == sink.path.name)
    assert len(files) >= 3
    index.add_files(files)
    assert index.verify().links == []  # control
    files[1].unlink()
    report = index.verify()
    assert any(f.missing for f in report.files)
    assert len(report.links) == 1 and "does not continue" in report.links[0]
