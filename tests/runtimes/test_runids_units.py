"""runids.RunIds, which scopes every "nothing left behind" check to its own gateway's runs: it must see
every run id written to the records directory, however briefly the record lived, and never answer
from an incomplete view."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from egressgate.runtimes import records
from tests.runtimes.runids import RunIds


def test_sees_every_record_written_since_the_watch_began(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "runs").mkdir(parents=True)
    records.write(state, "aaaaaaaaaa", {"before": True})
    records.remove(state, "aaaaaaaaaa")  # before the watch: not this watch's to know
    watch = RunIds(state / "runs")
    try:
        for run_id in ("0123456789", "abcdef0123"):  # written and removed between two looks
            records.write(state, run_id, {"owner_pid": 1})
            records.update(state, run_id, netns=f"egressgate-{run_id}")
            records.remove(state, run_id)
        records.write(state, "fedcba9876", {})  # still there
        (state / "runs" / "not-a-run.json").write_text("{}")
        assert watch.seen() == {"0123456789", "abcdef0123", "fedcba9876"}
        assert watch.seen() == {"0123456789", "abcdef0123", "fedcba9876"}  # ids are kept once drained
    finally:
        watch.close()


def test_an_ended_watch_is_an_error_not_an_empty_answer(tmp_path: Path) -> None:
    watch = RunIds(tmp_path / "runs")
    try:
        records.write(tmp_path, "0123456789", {})
        shutil.rmtree(tmp_path / "runs")
        with pytest.raises(RuntimeError, match="lost events or ended"):
            watch.seen()
    finally:
        watch.close()
