"""The live feed's tap on a real audit sink (FileSink on disk): a browser that stops reading is dropped
and never slows or blocks the audit writer; a reading one gets every record; both see only what the sink
accepted, once (tapping twice does not duplicate)."""

from __future__ import annotations

import asyncio
import time

from egressgate.admin.ui import live
from egressgate.audit.config import open_audit_sink
from egressgate.config import load_config
from tests.support.audit_events import http_event


async def test_a_stalled_client_is_dropped_and_the_writer_never_waits(tmp_path, monkeypatch):
    monkeypatch.setattr(live, "QUEUE_MAX", 8)
    cfg = load_config(None, {"var_dir": str(tmp_path)})
    sink = await open_audit_sink(cfg.audit, tmp_path)
    try:
        feed = live.LiveFeed(sink)
        live.LiveFeed(sink)  # a second console on the same sink swaps the observer, never taps twice
        feed = live.LiveFeed(sink)
        stalled, reader, other = live.Client({}), live.Client({}), live.Client({"sandbox": "sbx-2"})
        feed.clients.update({stalled, reader, other})
        got: list[dict] = []

        async def read() -> None:
            while len(got) < 40:
                got.append(await reader.queue.get())

        consumer = asyncio.create_task(read())
        started = time.monotonic()
        for i in range(40):
            await sink.write(http_event(i))
            await asyncio.sleep(0)  # let the reading client run, as a browser's task would
        elapsed = time.monotonic() - started
        await asyncio.wait_for(consumer, 5)
        assert stalled.dropped and stalled not in feed.clients  # dropped at its 9th record
        assert stalled.queue.qsize() == 1 and stalled.queue.get_nowait() is None  # its 8 records let go
        assert len(got) == 40 and len({r["request_id"] for r in got}) == 40  # every record, once
        assert other.queue.qsize() == 0 and not other.dropped  # its filter matched none
        assert elapsed < 5  # the writer went at disk speed with a stalled client attached
        await feed.close_all()
        assert feed.clients == set() and reader.queue.get_nowait() is None
    finally:
        await sink.close()


async def test_no_client_no_work_and_written_flag(tmp_path):
    cfg = load_config(None, {"var_dir": str(tmp_path)})
    sink = await open_audit_sink(cfg.audit, tmp_path)
    try:
        feed = live.LiveFeed(sink)
        feed.written = False
        await sink.write(http_event(1))
        assert feed.written is True and feed.clients == set()
    finally:
        await sink.close()


async def test_metrics_and_live_feed_share_one_tap_each_sees_a_record_once(tmp_path):
    """/metrics and the live feed observe through the one tap (audit/observe.py): installed on the same
    sink, in either order and twice over, each sees every accepted record exactly once."""
    from egressgate.admin import metrics

    cfg = load_config(None, {"var_dir": str(tmp_path)})
    sink = await open_audit_sink(cfg.audit, tmp_path)
    try:
        counted: list[str] = []
        metrics.install(sink, lambda e: counted.append(e.request_id))
        feed = live.LiveFeed(sink)
        metrics.install(sink, lambda e: counted.append(e.request_id))  # a second install swaps, no double count
        feed = live.LiveFeed(sink)
        reader = live.Client({})
        feed.clients.add(reader)
        events = [http_event(i) for i in (1, 2, 3)]
        await sink.write(events[0])
        sink.enqueue_after(events[1])
        await sink.write_after(events[2])
        assert counted == [e.request_id for e in events]  # once each, through all three write methods
        assert [reader.queue.get_nowait()["request_id"] for _ in range(3)] == counted and reader.queue.empty()
    finally:
        await sink.close()
