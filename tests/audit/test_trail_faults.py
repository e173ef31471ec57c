"""Faults of the trail itself, done for real to a running sink: the file unlinked, renamed, truncated from
outside; a crash leaving the file unsealed (with a partial line, or an edited tail); writes failing on a
genuinely full tmpfs while after-the-fact records wait. Each test checks that nothing is lost and that
`verify` passes across the fault, with a positive control showing verify still catches a real edit."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from types import SimpleNamespace

import pytest

from egressgate.audit.filesink import FileSink
from egressgate.audit.find import iter_records
from egressgate.audit.signer import load_public_keys
from egressgate.audit.verify import verify_file, verify_files
from egressgate.gateway.shared.limit_audit import LimitAudit
from egressgate.policy.reasons import Reason
from tests.audit.forge import line_index, rewrite_chain
from tests.support.audit_events import crash, fill_until_failure, http_event


def ids(*paths) -> list[str]:
    return [f.record.attributes["egressgate.request.id"] for f in iter_records(paths)
            if f.record.attributes.get("egressgate.operation") in ("http_request", "outcome")]


def history(path) -> list:
    """Every file of the trail, oldest first (rotated names sort by time, the live file last)."""
    rotated = sorted(p for p in path.parent.iterdir() if p.name.startswith("audit.") and p != path
                     and p.suffix == ".jsonl")
    return [*rotated, path]


def ops(path) -> list[str]:
    return [str(f.record.attributes.get("egressgate.operation")) for f in iter_records([path])]


async def until(cond, timeout: float = 10) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def full_disk_sink(tiny_fs, signer, **options) -> tuple[FileSink, object, list[str]]:
    """A sink on a genuinely full tmpfs (ENOSPC): (sink, the filler file to unlink for room, the ids it
    accepted before the disk filled)."""
    filler = tiny_fs / "filler"
    filler.write_bytes(b"x" * 32 * 1024)
    sink = await FileSink(tiny_fs / "audit" / "audit.jsonl", signer, **options).start()
    accepted, _ = await fill_until_failure(sink)
    return sink, filler, accepted


async def write_burst(sink, start: int, n: int) -> list[str]:
    events = [http_event(start + i) for i in range(n)]
    await asyncio.gather(*(sink.write(e) for e in events))
    return [e.request_id for e in events]


# --- item 12: the live file is deleted -----------------------------------------------------------------

@pytest.mark.parametrize("how", ["unlink", "rm -rf directory"])
async def test_deleted_file_is_restored_and_the_chain_continues(make_sink, pubkey, how):
    sink = await make_sink(checkpoint_every=4, watch_interval=0.05)
    sent = await write_burst(sink, 0, 6)
    if how == "unlink":
        os.unlink(sink.path)
    else:
        shutil.rmtree(sink.path.parent)
    sent += await write_burst(sink, 100, 5)  # these still land in the deleted inode
    # the incident is noted before the new file is opened (in a worker thread): wait for both
    await until(lambda: sink.incidents and sink.path.exists())
    assert sink.incidents[0]["incident"] == "file_deleted"
    assert sink.status()["incidents"][0]["incident"] == "file_deleted"  # what /healthz shows
    sent += await write_burst(sink, 200, 5)
    await sink.close()
    files = history(sink.path)
    assert len(files) == 2, files  # the restored copy + the new live file
    keys = load_public_keys([pubkey])
    reps = verify_files(files, keys)
    assert all(r.ok for r in reps), [r.error for r in reps]
    assert reps[0].sealed and any("file_deleted" in w for w in reps[1].warnings)
    assert sorted(ids(*files)) == sorted(sent)  # nothing lost, nothing twice
    assert ops(files[1])[:2] == ["chain_start", "audit_incident"]
    # positive control: a record removed from the restored file is caught
    lines = files[0].read_bytes().splitlines(keepends=True)
    del lines[3]
    files[0].write_bytes(b"".join(lines))
    assert "records removed" in verify_files(files, keys)[0].error


async def test_file_deleted_just_before_stop_is_still_on_disk(make_sink, pubkey):
    """The reported failure: delete the file, stop the gateway - nothing was on disk. Close checks first."""
    sink = await make_sink(watch_interval=3600)  # no periodic check: only the one at close
    sent = await write_burst(sink, 0, 8)
    os.unlink(sink.path)
    await sink.close()
    files = history(sink.path)
    assert sorted(ids(*files)) == sorted(sent)
    reps = verify_files(files, load_public_keys([pubkey]))
    assert all(r.ok for r in reps), [r.error for r in reps]


# --- item 13: the live file is renamed / truncated from outside ------------------------------------------

@pytest.mark.parametrize("where", ["same-dir", "elsewhere", "logrotate-create"])
async def test_outside_rename_continues_the_chain(make_sink, pubkey, tmp_path, where):
    sink = await make_sink(checkpoint_every=5, watch_interval=0.05)
    sent = await write_burst(sink, 0, 7)
    moved = (sink.path.parent if where != "elsewhere" else tmp_path) / "audit.moved.jsonl"
    inflight = asyncio.gather(*(sink.write(http_event(50 + i)) for i in range(10)))
    os.rename(sink.path, moved)  # under traffic
    if where == "logrotate-create":
        fd = os.open(sink.path, os.O_WRONLY | os.O_CREAT, 0o600)  # logrotate's `create`: an empty file
        os.close(fd)
    await inflight
    await until(lambda: sink.incidents)
    sent += await write_burst(sink, 100, 6)
    await sink.close()
    files = [moved, sink.path]
    keys = load_public_keys([pubkey])
    reps = verify_files(files, keys)
    assert all(r.ok for r in reps), [r.error for r in reps]
    assert reps[0].sealed and reps[1].first_prev == reps[0].last_hash
    assert len(ids(*files)) == 23 and set(ids(*files)) >= set(sent)
    start = next(iter_records([sink.path])).record.attributes
    assert start["egressgate.operation"] == "chain_start" and start["egressgate.chain.seq"] == 0
    if where != "elsewhere":
        assert start["egressgate.chain.prev_file"] == "audit.moved.jsonl"
    # positive control: an edit of the moved file is caught
    rewrite_chain(moved, 3, "server.address", "evil.example")
    assert "bad signature" in verify_files(files, keys)[0].error


async def test_copytruncate_continues_the_chain(make_sink, pubkey, tmp_path):
    """logrotate copytruncate: copy the file, truncate it in place. The copy is unsealed, but the new
    chain in the truncated file links to it, so a later signature covers it."""
    sink = await make_sink(checkpoint_every=5, watch_interval=3600)  # the per-batch check must see it
    sent = await write_burst(sink, 0, 7)
    copy = tmp_path / "audit.copy.jsonl"
    shutil.copy(sink.path, copy)
    os.truncate(sink.path, 0)
    await asyncio.sleep(0.02)  # > FSTAT_INTERVAL: the next batch checks the file before it writes
    sent += await write_burst(sink, 100, 3)  # that batch starts a new chain first
    await sink.close()
    reps = verify_files([copy, sink.path], load_public_keys([pubkey]))
    assert all(r.ok for r in reps), [r.error for r in reps]
    assert any("signed late" in w for w in reps[1].warnings)
    assert sorted(ids(copy, sink.path)) == sorted(sent)
    assert sink.incidents[0]["incident"] == "file_truncated"


# --- item 15: crash ----------------------------------------------------------------------------------

async def test_crash_is_sealed_by_a_recovery_checkpoint(tmp_path, signer, pubkey):
    path = tmp_path / "audit" / "audit.jsonl"
    first = await FileSink(path, signer, checkpoint_every=3).start()
    sent = await write_burst(first, 0, 5)
    await crash(first)
    keys = load_public_keys([pubkey])
    assert verify_file(path, keys).error.startswith("truncated after seq")  # control: really unsealed
    with open(path, "ab") as fh:  # and the crash cut a line in half (never acknowledged)
        fh.write(b'{"resourceLogs":[{"resource"')
    second = await FileSink(path, signer).start()
    assert second.incidents[0]["incident"] == "crash_recovered"
    sent += await write_burst(second, 100, 2)
    await second.close()
    files = history(path)
    reps = verify_files(files, keys)
    assert all(r.ok for r in reps), [r.error for r in reps]
    assert reps[0].sealed and any("recovery checkpoint" in w for w in reps[0].warnings)
    assert sorted(ids(*files)) == sorted(sent)
    # positive control: a record removed from the crashed file is still caught
    lines = files[0].read_bytes().splitlines(keepends=True)
    del lines[-2]
    files[0].write_bytes(b"".join(lines))
    assert verify_files(files, keys)[0].error is not None


async def test_edited_crash_tail_is_not_signed_at_restart(tmp_path, signer, pubkey):
    """Someone edits the unsigned tail while the gateway is down: the restart must not launder the edit with
    a signature. (An edit whose whole chain is recomputed is undetectable in an unsigned tail, with or
    without this seal - docs/audit.md, limitation (b); the recovery checkpoint says the tail was signed late.)"""
    path = tmp_path / "audit" / "audit.jsonl"
    first = await FileSink(path, signer, checkpoint_every=3).start()
    await write_burst(first, 0, 4)  # chain_start, 2 records, checkpoint, 2 records (unsigned tail)
    await crash(first)
    last = len(path.read_bytes().splitlines()) - 1
    assert line_index(path, lambda a: a.get("egressgate.operation") == "checkpoint") == last - 2
    data = path.read_bytes().splitlines(keepends=True)
    data[last] = data[last].replace(b"api.openai.com", b"api.openai.org")
    path.write_bytes(b"".join(data))
    second = await FileSink(path, signer).start()
    await second.close()
    assert second.incidents[0]["incident"] == "crash_tail_invalid"
    keys = load_public_keys([pubkey])
    files = history(path)
    rep = verify_files(files, keys)[0]
    assert rep.error is not None and "record edited" in rep.error
    assert "recovery" not in files[0].read_text()  # nothing was appended to the edited file


# --- item 16: after-the-fact records when the write fails ---------------------------------------------------

async def test_outcomes_are_retried_never_dropped(tiny_fs, signer, pubkey, caplog):
    sink, filler, accepted = await full_disk_sink(tiny_fs, signer, checkpoint_every=10,
                                                   probe_interval=0.05, pending_max=3)
    outcomes = [http_event(7000 + i, kind="outcome") for i in range(5)]
    with caplog.at_level(logging.ERROR):
        results = [await sink.write_after(ev) for ev in outcomes]  # the disk is full: queued, not lost
    assert results == [False] * 5 and sink.status()["pending_records"] == 5
    for ev in outcomes:
        assert ev.request_id in caplog.text  # the log names every request id
    assert not sink.healthy()  # the retry queue is full: new requests would be denied
    filler.unlink()
    await until(lambda: sink.status()["pending_records"] == 0)
    assert sink.healthy() and sink.records_retried == 5
    await sink.close()
    rep = verify_file(sink.path, load_public_keys([pubkey]))
    assert rep.ok, rep.error
    assert ids(sink.path) == [*accepted, *(e.request_id for e in outcomes)]


async def test_queued_outcomes_are_named_when_the_sink_stops(tiny_fs, signer, caplog):
    """If the disk never comes back and there is no spool, the records cannot be written, but they are not
    silently dropped: each is named."""
    sink, _, _ = await full_disk_sink(tiny_fs, signer, probe_interval=0.05)
    ev = http_event(1, kind="outcome")
    assert await sink.write_after(ev) is False
    with caplog.at_level(logging.CRITICAL):
        await asyncio.wait_for(sink.close(), 10)
    assert sink.records_lost == 1 and f"AUDIT RECORD LOST: outcome record of request {ev.request_id}" in caplog.text


async def test_spooled_outcomes_are_written_by_the_next_start(tiny_fs, signer, pubkey, tmp_path):
    filler = tiny_fs / "filler"
    filler.write_bytes(b"x" * 32 * 1024)
    spool = tmp_path / "var" / "audit-retry.jsonl"  # not on the full volume
    path = tiny_fs / "audit" / "audit.jsonl"
    sink = await FileSink(path, signer, probe_interval=0.05, retry_spool=spool).start()
    accepted, _ = await fill_until_failure(sink)
    queued = [http_event(9000 + i, kind="outcome") for i in range(3)]
    for ev in queued:
        assert await sink.write_after(ev) is False
    await asyncio.wait_for(sink.close(), 10)  # the disk never came back while it ran
    assert sink.records_lost == 0 and all(ev.request_id in spool.read_text() for ev in queued)
    filler.unlink()
    again = await FileSink(path, signer, retry_spool=spool).start()
    await until(lambda: again.records_retried == 3)
    await again.close()
    files = history(path)
    reps = verify_files(files, load_public_keys([pubkey]))
    assert all(r.ok for r in reps), [r.error for r in reps]
    assert ids(*files) == [*accepted, *(e.request_id for e in queued)]
    assert spool.read_bytes() == b""


async def test_connection_limit_records_on_a_full_disk_are_queued_not_dropped(tiny_fs, signer, pubkey):
    """A limit refusal (gateway/shared/limit_audit.py) took effect whether or not its record is written: on a full
    disk the record is queued and retried like an outcome, never dropped; the summary of suppressed events
    too. Control: the same records are in the file once the disk has room again."""
    sink, filler, _ = await full_disk_sink(tiny_fs, signer, probe_interval=0.05)
    rt = SimpleNamespace(audit=sink, background=set())
    limits = LimitAudit(rt, per_second=1)
    limits.record(Reason.CONNECTION_LIMIT, "198.18.7.7", "over limits.max_connections_per_source")
    limits.record(Reason.CONNECTION_LIMIT, "198.18.7.7", "over limits.max_connections_per_source")
    limits.close()  # the summary of the suppressed second event
    await until(lambda: sink.status()["pending_records"] == 2)  # both queued for retry, none dropped
    filler.unlink()
    await until(lambda: sink.status()["pending_records"] == 0)
    await sink.close()
    assert verify_file(sink.path, load_public_keys([pubkey])).ok
    refused = [f.record.attributes for f in iter_records([sink.path])
               if f.record.attributes.get("egressgate.operation") == "connection"]
    assert [a.get("client.address") for a in refused] == ["198.18.7.7", "198.18.7.7"]
    assert [a.get("egressgate.suppressed") for a in refused] == [None, 1]


# --- issue 11: enqueue_after (no task per outcome) keeps the never-dropped rule -------------------------------

async def test_enqueued_outcomes_are_retried_never_dropped(tiny_fs, signer, pubkey, caplog):
    """A genuinely full disk: outcomes handed over with enqueue_after (nobody awaits them) land in the retry
    queue when their batch fails, are named in the log, and are written once the disk has room again."""
    sink, filler, accepted = await full_disk_sink(tiny_fs, signer, checkpoint_every=10,
                                                   probe_interval=0.05, pending_max=3)
    outcomes = [http_event(7100 + i, kind="outcome") for i in range(5)]
    with caplog.at_level(logging.ERROR):
        for ev in outcomes:
            assert sink.enqueue_after(ev) is None  # returns at once: no task, no await
        await until(lambda: sink.status()["pending_records"] == 5)
    for ev in outcomes:
        assert ev.request_id in caplog.text  # the log names every request id
    assert not sink.healthy()  # the retry queue is full: new requests would be denied
    filler.unlink()
    await until(lambda: sink.status()["pending_records"] == 0)
    assert sink.healthy() and sink.records_retried == 5 and sink.records_lost == 0
    await sink.close()
    rep = verify_file(sink.path, load_public_keys([pubkey]))
    assert rep.ok, rep.error
    assert ids(sink.path) == [*accepted, *(e.request_id for e in outcomes)]


async def test_enqueued_outcomes_are_written_by_close(tmp_path, signer, pubkey):
    """Positive control and the shutdown drain: enqueued and immediately closed, every record is in the
    verified file (close() waits for the writer's final batch)."""
    sink = await FileSink(tmp_path / "audit.jsonl", signer).start()
    events = [http_event(7200 + i, kind="outcome") for i in range(20)]
    for ev in events:
        sink.enqueue_after(ev)
    await asyncio.wait_for(sink.close(), 10)
    rep = verify_file(sink.path, load_public_keys([pubkey]))
    assert rep.ok, rep.error
    assert ids(sink.path) == [e.request_id for e in events] and sink.records_written >= 20


async def test_enqueued_outcomes_are_named_when_the_writer_dies(tmp_path, signer, caplog):
    """The writer task dies with records still in its queue: each is reported (AUDIT RECORD LOST with its
    request id), never silently dropped; one handed over afterwards is reported too."""
    sink = await FileSink(tmp_path / "audit.jsonl", signer).start()
    events = [http_event(7300 + i, kind="outcome") for i in range(3)]
    with caplog.at_level(logging.CRITICAL):
        for ev in events:
            sink.enqueue_after(ev)
        assert sink._writer is not None
        sink._writer.cancel()  # before it ran: the three are still queued
        with pytest.raises(asyncio.CancelledError):
            await sink._writer
        late = http_event(7399, kind="outcome")
        sink.enqueue_after(late)
    assert sink.records_lost == 4 and not sink.healthy()
    for ev in [*events, late]:
        assert f"AUDIT RECORD LOST: outcome record of request {ev.request_id}" in caplog.text


async def test_enqueued_outcomes_are_spooled_when_the_disk_never_returns(tiny_fs, signer, pubkey, tmp_path):
    filler = tiny_fs / "filler"
    filler.write_bytes(b"x" * 32 * 1024)
    spool = tmp_path / "var" / "audit-retry.jsonl"
    path = tiny_fs / "audit" / "audit.jsonl"
    sink = await FileSink(path, signer, probe_interval=0.05, retry_spool=spool).start()
    accepted, _ = await fill_until_failure(sink)
    queued = [http_event(7400 + i, kind="outcome") for i in range(3)]
    for ev in queued:
        sink.enqueue_after(ev)
    await asyncio.wait_for(sink.close(), 10)  # the final batch fails too: spooled, not lost
    assert sink.records_lost == 0 and all(ev.request_id in spool.read_text() for ev in queued)
    filler.unlink()
    again = await FileSink(path, signer, retry_spool=spool).start()
    await until(lambda: again.records_retried == 3)
    await again.close()
    files = history(path)
    assert all(r.ok for r in verify_files(files, load_public_keys([pubkey])))
    assert ids(*files) == [*accepted, *(e.request_id for e in queued)]


async def test_enqueued_outcome_rides_the_next_batch_or_its_timer(tmp_path, signer, pubkey):
    """An outcome joins the next record's batch (one os.write for both, outcome first); alone, its timer
    writes it within `after_delay` (it does not wait for traffic or close())."""
    sink = await FileSink(tmp_path / "audit.jsonl", signer, after_delay=0.05).start()
    first = http_event(7500)
    await sink.write(first)
    batches = sink.batches_written
    out1, dec2 = http_event(7501, kind="outcome"), http_event(7502)
    sink.enqueue_after(out1)
    await sink.write(dec2)
    assert sink.batches_written == batches + 1  # one batch for both
    alone = http_event(7503, kind="outcome")
    sink.enqueue_after(alone)
    await until(lambda: sink.batches_written == batches + 2, timeout=2)  # no traffic, no close: the timer
    assert alone.request_id in sink.path.read_text()
    await sink.close()
    assert verify_file(sink.path, load_public_keys([pubkey])).ok
    assert ids(sink.path) == [e.request_id for e in (first, out1, dec2, alone)]


# --- issue 23 item 4: the kill -9 window of an outcome with no traffic behind it ----------------------------

async def _written_within_turns(sink: FileSink, request_id: str, turns: int = 10) -> bool:
    """True once `request_id` is in the file, within `turns` turns of the event loop (no time has to pass)."""
    for _ in range(turns):
        await asyncio.sleep(0)
        if request_id in sink.path.read_text():
            return True
    return False


async def test_an_outcome_alone_is_written_as_soon_as_the_loop_is_idle(tmp_path, signer, pubkey):
    """Sparse traffic (nothing followed the last outcome within `after_delay`; at start): an outcome is written
    once the event loop has run what was ready, not after the 2 ms timer, so a kill -9 in between loses only
    what this loop turn handed over. Dense traffic (a record followed the last outcome at once) keeps the timer:
    the outcome rides the next record's batch, no extra write at c=1. Counted in loop turns, never in time;
    the dense case (a 5 s timer) is the positive control: the same turns leave its outcome unwritten."""
    sink = await FileSink(tmp_path / "audit.jsonl", signer, watch_interval=60, after_delay=5.0).start()
    await sink.write(http_event(7600))
    alone = http_event(7601, kind="outcome")
    sink.enqueue_after(alone)
    assert await _written_within_turns(sink, alone.request_id)  # sparse: written at idle
    batches = sink.batches_written
    await sink.write(http_event(7602))  # follows the outcome at once: traffic is dense now
    dense = http_event(7603, kind="outcome")
    sink.enqueue_after(dense)
    assert not await _written_within_turns(sink, dense.request_id)  # waits for a batch to ride (or the timer)
    await sink.write(http_event(7604))
    assert dense.request_id in sink.path.read_text() and sink.batches_written == batches + 2  # rode it
    await sink.close()
    assert verify_file(sink.path, load_public_keys([pubkey])).ok
