"""The manifest of a persistent workspace: every kept entry with its type, mode, size and sha256 (issue 22).

Written by `sandbox run` at the end of a run, after the workload is dead and the `persistence.save` /
`discard` selection has been applied (runtimes/persist.py); checked at the start of the next run
(`verify_manifest_hash`): a workspace whose content differs from the manifest the last run wrote was changed
outside any run, by something no policy decided about.

The walk is fdwalk.walk (O_NOFOLLOW from the parent's descriptor: a symlink left in the workspace is
recorded as a link, never followed; one file system; bounded by MAX_ENTRIES: a larger tree is refused, not
partly trusted). Owners are not recorded: a persistent workspace
changes hands at the start and end of every run (workload.prepare_workspace / release_workspace). Stdlib only.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterable
from typing import NamedTuple

from egressgate.runtimes.fdwalk import DIR_FLAGS, walk
from egressgate.runtimes.fdwalk import (
    TooLarge as TooLarge,  # re-exported: persist.py and callers catch manifest.TooLarge
)

MAX_ENTRIES = 1_000_000
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# never carried over (persistence discard keyword `shell_history`, and always): the shells' and REPLs' history
# files, wherever they are (HOME inside a sandbox is the workspace)
HISTORY_NAMES = frozenset(
    {
        ".bash_history",
        ".zsh_history",
        ".sh_history",
        ".ash_history",
        ".ksh_history",
        ".history",
        ".python_history",
        ".node_repl_history",
        ".mysql_history",
        ".psql_history",
        ".sqlite_history",
        ".lesshst",
        ".irb_history",
        ".rediscli_history",
        "fish_history",
    }
)

Entry = dict[str, object]  # {"t": "f"|"d"|"l"|"o", "mode": int, "size": int, "sha256": hex, "target": str}


def scan(root: str | os.PathLike[str], limit: int = MAX_ENTRIES) -> dict[str, Entry]:
    """workspace-relative path -> entry, for everything under `root` (root itself excluded); a tree of
    more than `limit` entries raises TooLarge (refused, not partly trusted)."""
    out: dict[str, Entry] = {}
    for found in walk(root, limit):
        st, path = found.st, found.path
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            out[path] = {"t": "d", "mode": mode}
        elif stat.S_ISREG(st.st_mode):
            out[path] = {"t": "f", "mode": mode, "size": st.st_size, "sha256": _digest(found.dir_fd, found.name)}
        elif stat.S_ISLNK(st.st_mode):
            out[path] = {"t": "l", "target": os.readlink(found.name, dir_fd=found.dir_fd)}
        else:
            out[path] = {"t": "o", "mode": mode}
    return out


def _digest(dfd: int, name: str) -> str:
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dfd)
    except OSError:
        return "unreadable"
    h = hashlib.sha256()
    try:
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
    except OSError:
        return "unreadable"
    finally:
        os.close(fd)
    return h.hexdigest()


def manifest_hash(entries: dict[str, Entry]) -> str:
    """sha256 over the canonical form (sorted paths, compact sorted JSON): what the audit record carries."""
    h = hashlib.sha256()
    for path in sorted(entries):
        h.update(json.dumps([path, entries[path]], sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


class Diff(NamedTuple):
    added: list[str]
    removed: list[str]
    changed: list[str]

    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def summary(self, limit: int = 5) -> str:
        parts = []
        for label, paths in (("added", self.added), ("removed", self.removed), ("changed", self.changed)):
            if paths:
                more = f" (+{len(paths) - limit} more)" if len(paths) > limit else ""
                parts.append(f"{label} {', '.join(paths[:limit])}{more}")
        return "; ".join(parts) or "no difference"


def diff(old: dict[str, Entry], new: dict[str, Entry]) -> Diff:
    """What turned `old` into `new` (sorted paths). Pure."""
    added = sorted(p for p in new if p not in old)
    removed = sorted(p for p in old if p not in new)
    changed = sorted(p for p in new if p in old and new[p] != old[p])
    return Diff(added, removed, changed)


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(r == "" or path == r or path.startswith(r + "/") for r in roots)


def _holds(path: str, roots: Iterable[str]) -> bool:
    """`path` is a directory on the way to one of `roots` (it must stay so they can)."""
    return any(r.startswith(path + "/") for r in roots)


def to_remove(entries: dict[str, Entry], save: list[str] | None, discard: list[str]) -> list[str]:
    """The minimal set of workspace-relative paths to delete so that only `save` (None: everything) minus
    `discard`, minus shell history files and anything that is not a regular file, directory or symlink,
    is left. `save`/`discard` are workspace-relative ("" is the whole workspace). Pure; sorted."""

    def keep(path: str, entry: Entry) -> bool:
        if _under(path, discard) or path.rsplit("/", 1)[-1] in HISTORY_NAMES or entry.get("t") == "o":
            return False
        return save is None or _under(path, save) or (entry.get("t") == "d" and _holds(path, save))

    gone: list[str] = []
    dropped: set[str] = set()
    for path in sorted(entries):
        parent = path.rsplit("/", 1)[0] if "/" in path else None
        if parent is not None and parent in dropped:
            dropped.add(path)  # removed with its parent
            continue
        if not keep(path, entries[path]):
            dropped.add(path)
            gone.append(path)
    return gone


def remove(root: str | os.PathLike[str], paths: list[str]) -> None:
    """Delete workspace-relative `paths` under `root`, every component opened with O_NOFOLLOW (a path is
    never followed out of the workspace through a symlink the workload left)."""
    top = os.open(root, DIR_FLAGS)
    try:
        for path in paths:
            *parents, name = path.split("/")
            dfd = os.dup(top)
            try:
                for part in parents:
                    nxt = os.open(part, DIR_FLAGS, dir_fd=dfd)
                    os.close(dfd)
                    dfd = nxt
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=dfd)
                else:
                    os.unlink(name, dir_fd=dfd)
            except OSError as exc:  # gone, or a parent is a symlink now (never followed): nothing to remove
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise
            finally:
                os.close(dfd)
    finally:
        os.close(top)


def kept(entries: dict[str, Entry], removed: list[str]) -> dict[str, Entry]:
    """`entries` without `removed` and everything under them. Pure."""
    gone = set(removed)
    out = {}
    for path, entry in entries.items():
        parts = path.split("/")
        if not any("/".join(parts[:i]) in gone for i in range(1, len(parts) + 1)):
            out[path] = entry
    return out


def relative(paths: list[str] | None, workspace: str) -> list[str] | None:
    """Sandbox paths under the workspace path -> workspace-relative ("" for the workspace itself); paths
    outside it and keywords dropped (nothing outside the workspace survives a run). None stays None."""
    if paths is None:
        return None
    ws = workspace.rstrip("/")
    out = []
    for path in paths:
        if path == ws:
            out.append("")
        elif path.startswith(ws + "/"):
            out.append(path[len(ws) + 1 :])
    return out
