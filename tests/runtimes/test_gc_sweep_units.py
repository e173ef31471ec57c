"""gc's orphan sweep lists host objects first and looks at each after: an object another gateway's run (or its
own teardown) removes in between must be skipped, not crash the whole sweep (`sandbox gc` died with
FileNotFoundError on /run/netns/<name> when host test groups ran side by side)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from egressgate.runtimes.gc import _younger


def test_a_vanished_object_is_left_alone_and_the_age_rule_still_holds(tmp_path: Path) -> None:
    now = time.time()
    assert _younger(tmp_path / "gone", now, 60) is True  # listed, then removed by its owner: not ours to touch
    old = tmp_path / "old"
    old.mkdir()
    os.utime(old, (now - 120, now - 120))
    assert _younger(old, now, 60) is False  # positive control: a real orphan past the grace is swept
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert _younger(fresh, now, 60) is True
