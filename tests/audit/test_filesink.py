"""The file sink: durable before return, group commit, permissions, rotation, restart, disk full."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time

import pytest

from egressgate.audit.event import AuditUnavailable
from egressgate.audit.filesink import FileSink
from egressgate.audit.find import iter_records
from egressgate.audit.signer import load_public_keys
from egressgate.audit.verify import verify_file, verify_files
from tests.support.audit_events import fill_until_failure, http_event


def request_ids(*paths) -> list[str]:
    return [
        f.record.attributes["egressgate.request.id"]
        for f in iter_records(paths)
        if f.record.attributes.get("egressgate.operation") == "http_request"
    ]


async def test_record_is_on_disk_when_write_returns(make_sink):
    sink = await make_sink()
    ev = http_event(1)
    await sink.write(ev)
    with open(sink.path, "rb") as fh:  # a separate reader sees it before close: no user-space buffer
        assert ev.request_id.encode() in fh.read()


async def test_slow_inline_write_moves_writes_off_the_event_loop(make_sink, pubkey):
    """Batches are written inline only while that is fast; after a slow one (here: every write counts as
    slow) the next writes go to a worker thread until one is fast again, so a throttled disk cannot keep
    stalling the event loop."""
    sink = await make_sink(inline_slow=-1.0)
    await sink.write(http_event(1))
    assert sink.slow_inline_writes == 1
    for i in range(5):
        await sink.write(http_event(2 + i))
    assert sink.slow_inline_writes == 1  # the following batches did not run inline
    sink._batches.inline_slow = 10.0  # the disk is fast again: the next thread write sees it, then writes go inline
    await sink.write(http_event(8))
    await sink.write(http_event(9))
    assert sink._batches.inline_ok and sink.slow_inline_writes == 1
    await sink.close()
    rep = verify_file(sink.path, load_public_keys([pubkey]))
    assert rep.ok and rep.sealed, rep.error
    assert len(request_ids(sink.path)) == 8


async def test_writes_go_back_inline_even_when_thread_writes_look_slow(make_sink, pubkey):
    """A worker thread's write is timed until it has the GIL back, and a busy event loop (many
    connections per loop iteration) keeps the GIL for up to the 5 ms switch interval: under load every
    thread write looked slow, so after one slow inline write (a preempted process is enough) the sink paid
    a thread round trip per batch for good (seen in the issue 11 profiles). Here every write, inline or
    in a thread, counts as slow: the sink must still try inline again after `inline_retry` (default 1 s),
    and stay in threads in between (a slow disk stalls the loop at most once per retry period)."""
    sink = await make_sink(inline_slow=-1.0)
    await sink.write(http_event(1))
    assert sink.slow_inline_writes == 1 and not sink._batches.inline_ok
    n = 2
    started = time.monotonic()
    while time.monotonic() - started < 0.5:  # well within the retry period: threads only
        await sink.write(http_event(n))
        n += 1
    assert sink.slow_inline_writes == 1 and n > 3
    while time.monotonic() - started < 3.0 and sink.slow_inline_writes == 1:
        await sink.write(http_event(n))
        n += 1
        await asyncio.sleep(0.01)
    assert sink.slow_inline_writes == 2, "the sink never tried an inline write again"
    assert time.monotonic() - started >= 0.9
    sink._batches.inline_slow = 10.0  # the disk is fast: after the next retry the writes stay inline
    while time.monotonic() - started < 5.0 and not sink._batches.inline_ok:
        await sink.write(http_event(n))
        n += 1
        await asyncio.sleep(0.01)
    assert sink._batches.inline_ok
    await sink.close()
    rep = verify_file(sink.path, load_public_keys([pubkey]))
    assert rep.ok and rep.sealed, rep.error
    assert len(request_ids(sink.path)) == n - 1


async def test_lone_and_concurrent_records_keep_one_chain(make_sink, pubkey):
    """Lone records (a batch each), concurrent ones (batched), checkpoints in between: one valid chain
    with every record, in the order write() was called."""
    sink = await make_sink(checkpoint_every=7)
    expected: list[str] = []
    for round_ in range(6):
        for _ in range(3):  # lone
            event = http_event(len(expected))
            await sink.write(event)
            expected.append(event.request_id)
        burst = [http_event(len(expected) + i) for i in range(5 + round_)]  # concurrent: queued, batched
        await asyncio.gather(*(sink.write(e) for e in burst))
        expected.extend(e.request_id for e in burst)
    await sink.close()
    rep = verify_file(sink.path, load_public_keys([pubkey]))
    assert rep.ok and rep.sealed, rep.error
    assert request_ids(sink.path) == expected


async def test_concurrent_writers_share_flushes(make_sink, pubkey):
    sink = await make_sink(fsync=True)
    events = [http_event(i) for i in range(300)]
    await asyncio.gather(*(sink.write(e) for e in events))
    assert sink.batches_written < 60, sink.batches_written  # group commit: far fewer flushes than records
    await sink.close()
    assert sorted(request_ids(sink.path)) == sorted(e.request_id for e in events)
    assert verify_file(sink.path, load_public_keys([pubkey])).ok


async def test_file_and_directory_permissions(tmp_path, make_sink):
    d = tmp_path / "var"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)  # noqa: S103 - start from a world-readable directory
    sink = await make_sink(d / "audit.jsonl")
    await sink.write(http_event(1))
    assert stat.S_IMODE(os.stat(sink.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d).st_mode) & 0o007 == 0
    fresh = await make_sink(tmp_path / "new" / "sub" / "audit.jsonl")
    assert stat.S_IMODE(os.stat(fresh.path.parent).st_mode) == 0o700


async def test_refuses_symlinked_audit_path(tmp_path, signer):
    (tmp_path / "d").mkdir(mode=0o700)
    target = tmp_path / "elsewhere.jsonl"
    target.write_bytes(b"")
    os.symlink(target, tmp_path / "d" / "audit.jsonl")
    with pytest.raises(AuditUnavailable, match="not a regular file"):
        await FileSink(tmp_path / "d" / "audit.jsonl", signer).start()


async def test_rotation_loses_nothing_and_verifies_across_files(make_sink, pubkey):
    sink = await make_sink(max_bytes=8_000, checkpoint_every=7)
    events = [http_event(i) for i in range(80)]
    for chunk in range(0, 80, 10):  # concurrent bursts across rotations
        await asyncio.gather(*(sink.write(e) for e in events[chunk : chunk + 10]))
    await sink.close()
    assert sink.rotations >= 3
    rotated = sorted(p for p in sink.path.parent.iterdir() if p.name != sink.path.name and p.suffix == ".jsonl")
    files = [*rotated, sink.path]
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    reps = verify_files(files, load_public_keys([pubkey]))
    assert all(r.ok for r in reps), [r.error for r in reps]
    assert all(r.sealed for r in reps)
    assert sorted(request_ids(*files)) == sorted(e.request_id for e in events)  # each exactly once
    # removing a middle file breaks the link
    reps = verify_files([files[0], *files[2:]], load_public_keys([pubkey]))
    assert "does not continue" in reps[-1].error


async def test_restart_links_to_the_previous_file(tmp_path, signer, pubkey):
    path = tmp_path / "audit" / "audit.jsonl"
    first = await FileSink(path, signer).start()
    await first.write(http_event(1))
    await first.close()
    second = await FileSink(path, signer).start()
    await second.write(http_event(2))
    await second.close()
    old = [p for p in path.parent.iterdir() if p != path and p.suffix == ".jsonl"]
    assert len(old) == 1
    reps = verify_files([old[0], path], load_public_keys([pubkey]))
    assert all(r.ok for r in reps), [r.error for r in reps]


@pytest.mark.parametrize("inline_write_max", [256 * 1024, 0], ids=["inline-write", "thread-write"])
async def test_disk_full_denies_and_loses_no_accepted_record(tiny_fs, signer, pubkey, inline_write_max):
    filler = tiny_fs / "filler"
    filler.write_bytes(b"x" * 32 * 1024)
    sink = await FileSink(
        tiny_fs / "audit" / "audit.jsonl",
        signer,
        checkpoint_every=10,
        probe_interval=0.05,
        inline_write_max=inline_write_max,
    ).start()
    accepted, rejected = await fill_until_failure(sink)
    assert accepted and not sink.healthy()
    # concurrent writers on a full disk: every one is told, none silently dropped
    results = await asyncio.gather(*(sink.write(http_event(900 + i)) for i in range(20)), return_exceptions=True)
    assert all(isinstance(r, AuditUnavailable) for r in results)
    keys = load_public_keys([pubkey])
    rep = verify_file(sink.path, keys, allow_unsealed=True)
    assert rep.ok, rep.error  # no partial line left behind
    assert request_ids(sink.path) == accepted  # exactly the accepted records, in order
    assert rejected.request_id not in request_ids(sink.path)
    filler.unlink()  # space comes back: the probe checkpoint restores health without any request
    for _ in range(100):
        if sink.healthy():
            break
        await asyncio.sleep(0.05)
    assert sink.healthy()
    after = http_event(5000)
    await sink.write(after)
    await sink.close()
    rep = verify_file(sink.path, keys)
    assert rep.ok and rep.sealed, rep.error
    assert request_ids(sink.path) == [*accepted, after.request_id]


async def test_allow_and_alert_does_not_raise_but_reports(tiny_fs, signer):
    sink = await FileSink(tiny_fs / "a" / "audit.jsonl", signer, on_failure="allow-and-alert").start()
    for i in range(200):
        await sink.write(http_event(i))  # never raises
    assert sink.records_dropped > 0 and sink.degraded and sink.healthy()
    await asyncio.wait_for(sink.close(), 5)  # the final checkpoint fails on the full disk; close still ends


def test_sink_rejects_bad_config(signer):
    with pytest.raises(ValueError):
        FileSink(None, signer)
    with pytest.raises(ValueError):
        FileSink("/tmp/x", signer, on_failure="ignore")


async def test_dead_writer_fails_closed(make_sink):
    sink = await make_sink(on_failure="allow-and-alert")
    await sink.write(http_event(1))
    sink._writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sink._writer
    await asyncio.sleep(0)  # the done callback runs
    assert not sink.healthy()
    with pytest.raises(AuditUnavailable):
        await asyncio.wait_for(sink.write(http_event(2)), 2)
