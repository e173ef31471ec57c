"""The one walk over sandbox-written trees (runtimes/fdwalk.py) and its two users: the workspace manifest and
the set-id strip. Adversarial: planted symlinks, a mount inside the tree, an oversized tree, descriptors left
open by a consumer that stops early. Each refusal has its control (the same file inside the tree is seen).
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from egressgate.runtimes import manifest
from egressgate.runtimes.fdwalk import TooLarge, walk
from egressgate.runtimes.setid import strip_setid


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def setuid_file(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o4755)
    return path


def test_a_planted_symlink_is_reported_and_never_followed(tmp_path: Path):
    outside = tmp_path / "host"
    outside.mkdir()
    host_binary = setuid_file(outside / "passwd")
    root = tmp_path / "ws"
    root.mkdir()
    (root / "escape").symlink_to(outside)  # a directory link: must not be entered
    (root / "file-link").symlink_to(host_binary)
    inside = setuid_file(root / "tool")

    assert sorted(strip_setid(root)) == ["tool"]
    assert host_binary.stat().st_mode & stat.S_ISUID, "the walk followed a symlink out of the workspace"
    assert not inside.stat().st_mode & stat.S_ISUID  # the control: a set-id file inside is stripped

    entries = manifest.scan(root)
    assert entries["escape"] == {"t": "l", "target": str(outside)}
    assert entries["file-link"] == {"t": "l", "target": str(host_binary)}
    assert not any(path.startswith("escape/") for path in entries)


def test_a_root_that_is_a_symlink_is_not_walked(tmp_path: Path):
    real = tmp_path / "real"
    real.mkdir()
    setuid_file(real / "x")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(OSError):
        list(walk(tmp_path / "link", 10))
    assert strip_setid(tmp_path / "link") == []
    assert (real / "x").stat().st_mode & stat.S_ISUID
    assert strip_setid(real) == ["x"]  # the control: the real directory is walked


@pytest.mark.skipif(os.geteuid() != 0 and os.environ.get("CI") != "true", reason="mounting a tmpfs needs root")
def test_another_file_system_inside_the_tree_is_listed_but_not_entered(tmp_path: Path):
    root = tmp_path / "ws"
    (root / "mnt").mkdir(parents=True)
    (root / "plain").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root / "mnt")], check=True)
    try:
        setuid_file(root / "mnt" / "elsewhere")
        setuid_file(root / "plain" / "here")
        paths = [found.path for found in walk(root, 100)]
        assert "mnt" in paths and "mnt/elsewhere" not in paths
        assert "plain/here" in paths  # the control: a directory on the same file system is entered
    finally:
        subprocess.run(["umount", str(root / "mnt")], check=True)


def test_past_the_limit_the_walk_raises_and_the_strip_stops(tmp_path: Path):
    for i in range(5):
        setuid_file(tmp_path / f"f{i}")
    assert len(list(walk(tmp_path, 5))) == 5  # exactly the limit is fine
    with pytest.raises(TooLarge):
        list(walk(tmp_path, 4))
    with pytest.raises(manifest.TooLarge):
        manifest.scan(tmp_path, limit=4)


def test_no_descriptor_outlives_the_walk(tmp_path: Path):
    for d in range(4):
        sub = tmp_path / f"d{d}" / "deeper"
        sub.mkdir(parents=True)
        (sub / "f").write_text("x")
    before = open_fds()
    assert len(list(walk(tmp_path, 1000))) == 12
    assert open_fds() == before
    gen = walk(tmp_path, 1000)
    next(gen)
    next(gen)
    assert open_fds() > before  # the control: the walk holds descriptors while it runs
    gen.close()  # a consumer that stops early
    assert open_fds() == before
    with pytest.raises(TooLarge):
        list(walk(tmp_path, 3))
    assert open_fds() == before
