"""A record committed by its caller while the sink's writer task is parked (handoff.py `CallerCommit.commit`):
the same bytes as the writer task's batch, the same chain, the same failure answers, and no hand-over
(the caller does not wait for a loop iteration). Real sinks on real files, a real full disk."""

from __future__ import annotations

import asyncio

from egressgate.audit.event import AuditUnavailable
from egressgate.audit.filesink import FileSink
from egressgate.audit.find import iter_records
from egressgate.audit.signer import load_public_keys
from egressgate.audit.verify import verify_file, verify_files
from tests.support.audit_events import http_event

T0 = 1_795_000_000_000_000_000


def ids(*paths) -> list[str]:
    return [
        f.record.attributes["egressgate.request.id"]
        for f in iter_records(paths)
        if "egressgate.request.id" in f.record.attributes
    ]


def eager(coro) -> asyncio.Task:
    """Run `coro` at once, up to its first suspension (done() then says whether it suspended at all)."""
    return asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)


async def until(cond, timeout: float = 30) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _script(sink: FileSink, events: list) -> None:
    """Lone decisions, outcomes riding the next decision, outcomes written alone, concurrent bursts, and
    checkpoints in between (checkpoint_every is small)."""
    it = iter(events)
    for round_ in range(4):
        for _ in range(3):
            await sink.write(next(it))
        sink.enqueue_after(next(it))  # rides the next decision's batch (or is written at idle)
        await sink.write(next(it))
        sink.enqueue_after(next(it))
        await asyncio.sleep(0.01)  # written alone (idle, or its timer)
        await asyncio.gather(*(sink.write(next(it)) for _ in range(2 + round_)))


async def test_same_bytes_as_the_writer_task(tmp_path, signer, pubkey):
    """The same script through a sink that commits in the caller and through one whose records all go
    to the writer task gives byte-identical files (one chain, same records, same checkpoints), and the
    first sink did commit most records in the caller (positive control: the second did none)."""
    events = [http_event(i) for i in range(sum(8 + r for r in range(4)))]  # what _script takes
    files = []
    inline_counts = []
    for name, allow_inline in (("inline", True), ("writer", False)):
        sink = await FileSink(
            tmp_path / name / "audit.jsonl", signer, checkpoint_every=5, clock=lambda: T0, inline_slow=10.0
        ).start()
        commits = []
        real = sink._handoff.commit

        def counted(record, real=real, commits=commits, allow_inline=allow_inline):
            done = allow_inline and real(record)
            commits.append(done)
            return done

        sink._handoff.commit = counted
        await _script(sink, events)
        await sink.close()
        inline_counts.append(sum(commits))
        files.append(sink.path)
    assert inline_counts[0] >= 10 and inline_counts[1] == 0, inline_counts
    keys = load_public_keys([pubkey])
    for path in files:
        rep = verify_file(path, keys)
        assert rep.ok and rep.sealed, rep.error
    assert files[0].read_bytes() == files[1].read_bytes()
    assert sorted(ids(files[0])) == sorted(e.request_id for e in events)


async def test_a_parked_writer_means_no_hand_over(make_sink, pubkey):
    """With the writer parked on an empty queue a record is durable before write() first yields: no
    future, no loop iteration; an outcome written at idle is written by the idle callback itself (the
    writer is not woken). Positive controls: the first record of a file (its chain_start), and a record
    behind one already queued for the writer, are handed over (write() suspends)."""
    sink = await make_sink(watch_interval=60, inline_slow=10.0)  # a preempted write must not count as slow
    events = [http_event(1), http_event(2), http_event(3), http_event(4, kind="outcome")]
    first = eager(sink.write(events[0]))
    second = eager(sink.write(events[1]))
    assert not first.done()  # seq 0: the writer task writes chain_start with it
    assert not second.done()  # behind it in the queue: in order, through the writer
    await asyncio.gather(first, second)
    batches = sink.batches_written
    task = eager(sink.write(events[2]))
    assert task.done() and task.exception() is None
    assert events[2].request_id in sink.path.read_text() and sink.batches_written == batches + 1
    sink.enqueue_after(events[3])  # sparse traffic: written once the loop has run what was ready ...
    assert events[3].request_id not in sink.path.read_text()
    await asyncio.sleep(0)  # ... here, at once
    assert events[3].request_id in sink.path.read_text() and sink.batches_written == batches + 2
    assert sink._queue.empty()  # ... without waking the writer task
    await sink.close()
    rep = verify_file(sink.path, load_public_keys([pubkey]))
    assert rep.ok and rep.sealed, rep.error
    assert ids(sink.path) == [e.request_id for e in events]


async def test_no_inline_commit_when_a_checkpoint_or_rotation_is_due(make_sink, pubkey):
    """A batch that needs a signature or a new file goes to the writer task (which awaits them); the
    chain still verifies across the rotated files, with every record once."""
    sink = await make_sink(checkpoint_every=3, max_bytes=20_000, watch_interval=60, inline_slow=10.0)
    events = [http_event(i) for i in range(40)]
    handed_over = 0
    for ev in events:
        task = eager(sink.write(ev))
        if not task.done():
            handed_over += 1
            await task
    await sink.close()
    assert sink.rotations >= 2
    assert handed_over >= 40 // 3  # every third record carries a checkpoint (and each new file a chain_start)
    assert handed_over < 40  # ... the others did not wait (positive control)
    files = sorted(p for p in sink.path.parent.iterdir() if p.suffix == ".jsonl" and p != sink.path)
    reps = verify_files([*files, sink.path], load_public_keys([pubkey]))
    assert all(r.ok and r.sealed for r in reps), [r.error for r in reps]
    assert sorted(ids(*files, sink.path)) == sorted(e.request_id for e in events)  # each once


async def test_an_inline_commit_that_fails_denies_and_retries_the_outcomes_it_took(tiny_fs, signer, pubkey):
    """The disk fills during a caller's own commit: the caller gets AuditUnavailable (it denies), no partial
    line stays, the sink is unhealthy, and the outcome records that commit had taken are queued for retry
    (never dropped) and written once the disk has room again."""
    filler = tiny_fs / "filler"
    filler.write_bytes(b"x" * 32 * 1024)
    sink = await FileSink(
        tiny_fs / "audit" / "audit.jsonl",
        signer,
        probe_interval=0.05,
        watch_interval=60,
        checkpoint_every=10_000,
        after_delay=60,
        inline_slow=10.0,
    ).start()
    await sink.write(http_event(0))
    accepted, outcomes, i = [], [], 1
    while True:
        out = http_event(10_000 + i, kind="outcome")
        sink.enqueue_after(out)  # dense traffic (after_delay 60 s): it waits to ride the next decision
        outcomes.append(out.request_id)
        ev = http_event(i)
        task = eager(sink.write(ev))
        assert task.done(), "handed to the writer: this test needs the caller's own commit"
        if task.exception() is not None:
            assert isinstance(task.exception(), AuditUnavailable)
            break
        accepted.append(ev.request_id)
        i += 1
        assert i < 5000, "the disk never filled"
    assert not sink.healthy() and sink.write_failures == 1
    assert sink.status()["pending_records"] == 1  # the outcome the failed commit had taken
    keys = load_public_keys([pubkey])
    assert verify_file(sink.path, keys, allow_unsealed=True).ok  # cut back to the last complete batch
    assert ev.request_id not in sink.path.read_text()
    filler.unlink()
    # the writer was parked with a 60 s idle timeout: the failed commit must wake it to probe every 50 ms
    await until(lambda: sink.healthy() and sink.status()["pending_records"] == 0)
    await sink.close()
    rep = verify_file(sink.path, keys)
    assert rep.ok and rep.sealed, rep.error
    written = ids(sink.path)
    assert [x for x in written if x in accepted] == accepted
    assert sorted(x for x in written if x in outcomes) == sorted(outcomes)  # every outcome, once
