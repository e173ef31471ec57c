"""The audit index over files a real FileSink wrote: find by every key, read the record back from the JSONL,
index incrementally (only new lines), agree with the JSON parser on hostile records."""

from __future__ import annotations

import json
import os
import stat

from egressgate.audit.chain import ChainWriter
from egressgate.audit.event import EventKind
from egressgate.audit.find import find_records
from egressgate.audit.index import AuditIndex
from egressgate.audit.index.extract import fast_values, fields_of, json_fields, json_values
from egressgate.audit.record import record_from_event
from tests.support.audit_events import http_event

RH = "sha256:" + "c1" * 32


async def test_find_and_read_back_what_the_sink_wrote(make_sink, index):
    sink = await make_sink()
    await sink.write(http_event(1, request_id="req-a", request_hash=RH))
    await sink.write(http_event(2, request_id="req-b", sandbox_id="sbx-2", host="evil.example", decision="deny",
                                reason="no_rule_matched", rule_id=None))
    await sink.write(http_event(3, request_id="req-a", kind=EventKind.OUTCOME, status=200))
    await sink.close()
    stats = index.add_files([sink.path])
    lines = sink.path.read_bytes().splitlines()
    assert stats.added == len(lines) == 5  # chain_start, 3 records, final checkpoint
    assert stats.broken == [] and stats.rebuilt == []

    (hit,) = index.find(request_hash=RH)
    assert (hit.request_id, hit.line, hit.chain_index, hit.verified) == ("req-a", 2, 1, True)
    assert index.record_line(hit) == lines[1]
    assert index.record(hit) == json.loads(lines[1])
    # a bare or upper-case digest finds it too (as `audit find` accepts it)
    assert index.find(request_hash=RH.removeprefix("sha256:").upper()) == [hit]
    assert [h.kind for h in index.find(request_id="req-a")] == ["outcome", "http_request"]  # newest first
    (deny,) = index.find(decision="deny")
    assert (deny.host, deny.sandbox, deny.reason, deny.rule) == ("evil.example", "sbx-2", "no_rule_matched", None)
    assert index.find(host="evil.example", sandbox="sbx-1") == []  # filters are ANDed
    assert [h.kind for h in index.find(kind="checkpoint")] == ["checkpoint"]
    assert all(h.verified for h in index.find(limit=100))
    # the scan (`audit find` without index) finds the same decision (and its outcome, by request id)
    assert [f.line for f in find_records([sink.path], request_hash=RH)] == [hit.line, 4]
    # paging
    first = index.find(limit=2)
    rest = index.find(limit=100, before_rowid=first[-1].rowid)
    assert len(first) + len(rest) == 5 and {h.rowid for h in first}.isdisjoint({h.rowid for h in rest})


async def test_second_run_indexes_only_new_lines_and_checks_the_link_across_runs(make_sink, index, tmp_path):
    sink = await make_sink()
    for i in range(5):
        await sink.write(http_event(i, request_id=f"r{i}"))
    assert index.add_files([sink.path]).added == 6
    assert index.add_files([sink.path]).added == 0  # nothing new
    for i in range(5, 8):
        await sink.write(http_event(i, request_id=f"r{i}"))
    again = index.add_files([sink.path])
    assert again.added == 3 and again.rebuilt == []
    hits = index.find(limit=100)
    assert [h.line for h in hits] == list(range(9, 0, -1))
    assert all(h.verified for h in hits)
    assert [h.chain_index for h in hits] == list(range(8, -1, -1))


async def test_index_file_is_private(index, tmp_path):
    mode = stat.S_IMODE(os.stat(index.db_path).st_mode)
    assert mode & 0o077 == 0, oct(mode)


def test_fast_extraction_agrees_with_json_on_hostile_records():
    """A label or `extra` key may spell a top-level attribute (`egressgate.request.hash`...): the index must
    read the record's own attribute, never the nested one. Escapes, quotes and non-ASCII go to json."""
    planted = "sha256:" + "66" * 32
    hostile = {"egressgate.request.hash": planted, "egressgate.request.id": "forged", "server.address": "x",
               "egressgate.decision": "allow", 'a"b': "\\", "egressgate.chain.seq": "7"}
    events = [
        # the plain planted label, no escape anywhere: the fast path itself must skip it
        http_event(9, sandbox_labels={"egressgate.request.hash": planted, "egressgate.request.id": "forged"},
                   request_hash=None),
        http_event(1, sandbox_labels=hostile, request_hash=None),  # no top-level hash: must stay None
        http_event(2, sandbox_labels=hostile, request_hash=RH),
        http_event(3, host='ev"il\\.example\u202e', path="/<script>", sandbox_labels={"k": "v"}),
        http_event(4, extra={"egressgate.nested": {"egressgate.request.id": "forged2", "egressgate.rule": "r"}},
                   rule_id=None),
        http_event(5, sandbox_id="sbx-\u00e9", request_hash=RH, sandbox_labels={}),
        http_event(6, kind=EventKind.OUTCOME, status=403, sandbox_labels=hostile, request_hash=None),
        # attribute-shaped text inside values: escaped quotes, so json decides
        http_event(7, path='/{"key":"egressgate.request.hash","value":{"stringValue":"' + planted + '"}}',
                   request_hash=None, sandbox_labels={}),
        # a kvlist inside an array inside extra (approvals are recorded like this)
        http_event(8, extra={"egressgate.grants": [{"egressgate.request.id": "forged3", "x": ["a", {"b": "c"}]}]},
                   sandbox_labels=hostile),
    ]
    w = ChainWriter()
    for number, ev in enumerate(events, start=1):
        line = w.append(record_from_event(ev))
        oracle = json_fields(line)
        assert fields_of(line) == oracle
        fast = fast_values(line)
        if fast is not None:  # when the fast path answers, it answers exactly what json says
            assert fast == json_values(line)
        else:
            assert number in (4, 6, 8)  # an escaped quote / non-ASCII in a value: json decides
        assert oracle.request_id == ev.request_id
        assert oracle.request_hash == ev.request_hash
        assert oracle.rule == ev.rule_id
        assert oracle.seq == w.state.seq - 1
    # positive control: the planted hash is in the line the fast path read, so a plain search was fooled
    line = w.append(record_from_event(events[0]))
    assert fast_values(line) is not None and planted.encode() in line


async def test_two_files_and_a_restricted_search(make_sink, tmp_path, index):
    a = await make_sink(tmp_path / "audit" / "audit.w0.jsonl")
    b = await make_sink(tmp_path / "audit" / "audit.w1.jsonl")
    await a.write(http_event(1, request_id="same", request_hash=RH))
    await b.write(http_event(2, request_id="same", request_hash=RH))
    await a.close()
    await b.close()
    stats = index.add_files([a.path, b.path])
    assert stats.files == 2 and stats.added == 6
    hits = index.find(request_hash=RH)
    assert sorted(h.file for h in hits) == sorted([str(a.path), str(b.path)])
    assert all(h.verified and h.chain_index == 1 for h in hits)
    (only_b,) = index.find(request_hash=RH, files=[b.path])
    assert only_b.file == str(b.path)
    reopened = AuditIndex(index.db_path)  # another reader of the same database
    try:
        assert len(reopened.find(request_hash=RH)) == 2
    finally:
        reopened.close()
