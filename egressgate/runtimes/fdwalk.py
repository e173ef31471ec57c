"""The one way egressgate walks a directory tree a sandbox could have written (a persistent workspace).

Why this walk and no other: the tree's content is the sandbox's, so a name in it may be a symlink planted to
lead a host-side walker elsewhere, or a mount point onto another file system. Every directory is opened
relative to its parent's descriptor with O_NOFOLLOW (a symlink is reported as a link, never followed, and a
directory swapped for a symlink after its stat cannot be opened), the walk stays on the root's file system
(`st_dev`), and it is bounded: more than `limit` entries raises TooLarge (a caller either refuses the tree or
stops there). Users: the workspace manifest (manifest.py) and the set-id strip (setid.py). Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import NamedTuple

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TooLarge(RuntimeError):
    """The tree has more entries than the walk's limit."""


class Found(NamedTuple):
    dir_fd: int  # the parent directory, open while the entry is being looked at (use with dir_fd=)
    name: str  # the entry's name in that directory
    path: str  # root-relative path, "/"-joined
    st: os.stat_result  # lstat of the entry


def walk(root: str | os.PathLike[str], limit: int) -> Iterator[Found]:
    """Every entry under `root` (root itself excluded), parents before children; raises OSError when `root`
    cannot be opened as a directory without following a symlink, and TooLarge past `limit` entries. An
    entry that vanishes between the listing and its stat is skipped; a directory that cannot be listed or
    opened is reported but not entered."""
    top = os.open(root, DIR_FLAGS)
    dev = os.fstat(top).st_dev
    stack: list[tuple[int, str]] = [(top, "")]
    seen = 0
    try:
        while stack:
            dfd, rel = stack.pop()
            try:
                try:
                    names = os.listdir(dfd)
                except OSError:
                    names = []
                for name in names:
                    seen += 1
                    if seen > limit:
                        raise TooLarge(f"more than {limit} entries")
                    try:
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    except OSError:
                        continue
                    path = f"{rel}/{name}" if rel else name
                    yield Found(dfd, name, path, st)
                    if stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                        with contextlib.suppress(OSError):
                            stack.append((os.open(name, DIR_FLAGS, dir_fd=dfd), path))
            finally:
                os.close(dfd)
    finally:
        for dfd, _ in stack:
            with contextlib.suppress(OSError):
                os.close(dfd)
