"""A genuinely full disk for fail-closed tests: a tiny real tmpfs (ENOSPC), never a simulated one."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.env import IN_CI


@contextlib.contextmanager
def tiny_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """Mount a `size` tmpfs (mode 0700) on the new directory `mnt`; lazily unmounted after. Needs root
    (skips without it, except in CI where root is a requirement)."""
    if os.geteuid() != 0 and not IN_CI:
        pytest.skip("mounting a tmpfs needs root")
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path) -> Path:
    """Write a filler file until the tmpfs is full; returns it (delete it to free the space)."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 1024)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler
