"""runtimes/runlock.py without a sandbox: what `sandbox gc` counts as a live run (fail closed)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from egressgate.runtimes import runlock

A, B, C, D = "a0a0a0a0a0", "b1b1b1b1b1", "c2c2c2c2c2", "d3d3d3d3d3"


def test_held_locks_are_live_and_dead_ones_are_removed(tmp_path: Path) -> None:
    fd = runlock.hold(A, tmp_path)
    (tmp_path / B).write_text("")  # a run killed with its watchdog: the file, no lock
    try:
        assert runlock.held(tmp_path) == {A}
        assert (tmp_path / A).exists() and not (tmp_path / B).exists()
        with pytest.raises(runlock.LockFailed):  # the same id cannot be taken twice
            runlock.hold(A, tmp_path)
    finally:
        runlock.release(A, fd, tmp_path)
    assert runlock.held(tmp_path) == set() and not (tmp_path / A).exists()


def test_a_lock_that_cannot_be_checked_counts_as_live(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / C).symlink_to(tmp_path / "elsewhere")  # O_NOFOLLOW refuses it: not checkable
    (tmp_path / D).write_text("")  # the control: a plain unlocked file is a dead run's
    assert runlock.held(tmp_path) == {C}
    assert not (tmp_path / D).exists()


def test_an_unlistable_lock_directory_stops_the_sweep(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "locks"
    not_a_dir.write_text("")
    with pytest.raises(runlock.LockFailed):
        runlock.held(not_a_dir)
    assert runlock.held(tmp_path / "missing") == set()  # the control: no directory, no run ever


def test_the_lock_is_on_the_file_at_the_path(tmp_path: Path) -> None:
    fd = runlock.hold(A, tmp_path)
    try:
        probe = os.open(tmp_path / A, os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.close(probe)
        assert fd > 2
    finally:
        runlock.release(A, fd, tmp_path)
