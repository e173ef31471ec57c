"""Is the file the sink writes to still the audit file at `path`? (deleted, moved, truncated from outside)

Why: the sink writes through an open descriptor. If someone deletes `audit.jsonl`, every later record goes
to an inode nobody can see and vanishes when the gateway exits; if someone moves it (`mv`, logrotate), the
records keep going into the moved file and nothing starts a new chain at `path`. The writer task checks the
file's identity at most every `watch_interval` and at close; on a change it seals what it has, starts a new
file whose chain continues from the last record, and records an `audit_incident`.

A deleted file is *salvaged*: while the descriptor is open the inode still holds every record, and Linux
lets us reopen it through `/proc/self/fd/N`, so the sink copies it (sealed) to a rotated name.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

FileChange = Literal["ok", "deleted", "moved", "truncated"]


def rotated_name(path: Path, now: datetime | None = None) -> Path:
    """`audit.jsonl` -> `audit.20261129T140102_123456Z.jsonl` (sorts by time; never overwrites)."""
    now = now or datetime.now(UTC)
    stamp = now.strftime("%Y%m%dT%H%M%S_%fZ")
    candidate = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
        n += 1
    return candidate


_STAMP = re.compile(r"\d{8}T\d{6}_\d{6}Z(?:-(\d+))?")


def newest_rotated(path: Path) -> Path | None:
    """The most recent file `rotated_name(path)` produced, or None (files of other chains, such as a
    worker's `audit.w1.<stamp>.jsonl` beside `audit.jsonl`, never match)."""
    best: tuple[str, int] | None = None
    found = None
    prefix, suffix = f"{path.stem}.", path.suffix
    try:
        names = os.listdir(path.parent)
    except OSError:
        return None
    for name in names:
        if not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        match = _STAMP.fullmatch(name[len(prefix):len(name) - len(suffix)])
        if match is None:
            continue
        key = (match.group(0).split("-")[0], int(match.group(1) or 0))
        if best is None or key > best:
            best, found = key, path.with_name(name)
    return found


def chain_name(path: Path) -> str:
    """The live file name a (possibly rotated) audit file belongs to, i.e. its chain: `audit.w1.<stamp>.jsonl`
    and `audit.w1.jsonl` -> `audit.w1.jsonl` (`audit verify --per-worker`)."""
    stem, dot, last = path.stem.rpartition(".")
    if dot and _STAMP.fullmatch(last):
        return f"{stem}{path.suffix}"
    return path.name


def secure_directory(directory: Path) -> None:
    """Create the audit directory 0700; strip world access from an existing one (audit files leak)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o007:
        log.warning("audit directory %s had mode %04o; removing world access", directory, mode)
        os.chmod(directory, mode & ~0o007)


def file_change(fd: int, path: Path, written: int) -> FileChange:
    """What happened to the file open on `fd`, which should be `path` holding `written` bytes."""
    st = os.fstat(fd)
    if st.st_nlink == 0:
        return "deleted"
    try:
        cur = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return "moved"
    if (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
        return "moved"
    if st.st_size < written:  # e.g. logrotate copytruncate: the records were copied elsewhere (or not)
        return "truncated"
    return "ok"


def find_by_inode(directory: Path, fd: int) -> str | None:
    """Name of the moved file if it is still in the audit directory (else None: moved elsewhere)."""
    st = os.fstat(fd)
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if (entry.inode() == st.st_ino and entry.is_file(follow_symlinks=False)
                        and entry.stat(follow_symlinks=False).st_dev == st.st_dev):
                    return entry.name
    except OSError:
        return None
    return None


def salvage_deleted(fd: int, target: Path, fsync: bool) -> int:
    """Copy the deleted inode open on `fd` to `target` (created 0600, never overwritten); returns bytes."""
    src = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    total = 0
    try:
        while chunk := os.read(src, 1 << 20):
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst, view) :]
            total += len(chunk)
        if fsync:
            os.fsync(dst)
    except BaseException:
        os.close(dst)
        dst = -1
        target.unlink(missing_ok=True)  # a partial copy would be an unverifiable file
        raise
    finally:
        os.close(src)
        if dst >= 0:
            os.close(dst)
    return total


def rename_by_name(path: Path, target: Path) -> tuple[bool, OSError | None]:
    """(renamed, the error when not): `path` may have been moved away meanwhile (FileNotFoundError)."""
    try:
        os.rename(path, target)
    except OSError as exc:
        return False, exc
    return True, None


def located(fd: int, directory: Path, target: Path | None) -> str | None:
    """The name of the file open on `fd` in the audit directory: `target` when the rename moved it, else
    wherever an outside `mv` put it (None: outside the directory, or deleted)."""
    if target is not None:
        try:
            st, cur = os.fstat(fd), os.stat(target, follow_symlinks=False)
        except OSError:
            return find_by_inode(directory, fd)
        if (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino):
            return target.name
    return find_by_inode(directory, fd)


def give_back(target: Path, path: Path) -> None:
    """Undo our rename of a file that was not ours: it gets its name back unless something took the name
    again (a link never overwrites). The sink's `_open_fresh` then uses it if empty, else moves it aside."""
    try:
        os.link(target, path, follow_symlinks=False)
        os.unlink(target)
    except OSError as exc:
        log.warning("could not give %s its name %s back: %s", target, path, exc)
