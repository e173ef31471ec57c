"""Index one audit file incrementally: what changed since the last run, and the rows of its new lines.

The index is derived from the JSONL and never trusted over it. Rules enforced here:
* a file is known by its identity (device, inode, SHA-256 of its first line) and by the SHA-256 of the last
  line indexed: a file replaced under the same name, truncated, or whose first or last indexed line changed
  is re-indexed from byte 0 (`changed()`); an edit in the middle that keeps every length is caught when the
  record is read back (`AuditIndex.record` re-checks the bytes) and by `AuditIndex.verify` (full re-read);
* only complete lines are indexed: a partial last line (a writer mid-append) is left for the next run;
* every line's chain link is checked as it is indexed (its own hash, its seq, its link to the previous
  line, chain_start first, nothing after the final checkpoint: the rules of audit/verify.py), and the state
  needed to continue the check is stored with the file, so a link is checked across incremental runs; after
  the first break every later record of the file is `verified = False`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from egressgate.audit.chain import OP_CHAIN_START
from egressgate.audit.index.extract import LineError, fields_of

CHUNK = 8 << 20  # bytes read per step (one SQLite transaction per step)

# files table columns, in FileState field order
FILE_COLUMNS = ("id", "path", "dev", "ino", "head_sha", "head_len", "indexed_size", "lines", "next_seq", "last_hash",
                "tail_off", "tail_sha", "broken_line", "broken_reason", "sealed", "first_prev")


@dataclass(slots=True)
class FileState:
    id: int | None
    path: str
    dev: int
    ino: int
    head_sha: str | None = None  # SHA-256 of the first line (newline included): the file's identity
    head_len: int = 0
    indexed_size: int = 0  # bytes indexed: the offset of the first line not indexed yet
    lines: int = 0  # complete lines indexed (line numbers are 1-based)
    next_seq: int = 0  # chain state carried across runs
    last_hash: str | None = None
    tail_off: int = 0  # offset of the last line indexed, and the SHA-256 of its bytes
    tail_sha: str | None = None
    broken_line: int | None = None  # first line whose chain link failed (every later line is unverified)
    broken_reason: str | None = None
    sealed: bool = False
    first_prev: str | None = None  # chain.prev of seq 0: the previous file's last hash (or 64 "0")

    def as_row(self) -> tuple:
        return tuple(getattr(self, c) for c in FILE_COLUMNS)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def changed(fd: int, st: os.stat_result, state: FileState) -> str | None:
    """Why the bytes indexed for `state` are no longer the file open on `fd` (None: only appended to)."""
    if (st.st_dev, st.st_ino) != (state.dev, state.ino):
        return "replaced (a different file now has this name)"
    if st.st_size < state.indexed_size:
        return f"truncated ({st.st_size} bytes, {state.indexed_size} were indexed)"
    if state.head_sha is not None and _sha(os.pread(fd, state.head_len, 0)) != state.head_sha:
        return "first record changed"
    if state.tail_sha is not None:
        size = state.indexed_size - state.tail_off
        if _sha(os.pread(fd, size, state.tail_off)) != state.tail_sha:
            return f"record at line {state.lines} changed"
    return None


def first_line_sha(fd: int, head_len: int) -> str:
    return _sha(os.pread(fd, head_len, 0))


def scan(fd: int, state: FileState, until: int) -> Iterator[tuple[list[tuple], int]]:
    """Index the complete lines between `state.indexed_size` and `until` (the size seen at open), one chunk
    at a time: yields (rows, partial bytes left) after updating `state`; the caller commits both."""
    chunk = CHUNK
    while state.indexed_size < until:
        pos = state.indexed_size
        data = os.pread(fd, min(chunk, until - pos), pos)
        if not data:
            return
        end = data.rfind(b"\n") + 1
        if end == 0:
            if pos + len(data) >= until:
                yield [], len(data)  # a partial last line: next time
                return
            chunk *= 2  # one line longer than a chunk
            continue
        yield _rows(state, data, end, pos), 0
        chunk = CHUNK


def _rows(state: FileState, data: bytes, end: int, base: int) -> list[tuple]:
    rows: list[tuple] = []
    append = rows.append
    fid = state.id
    offset = base
    lines = data[: end - 1].split(b"\n")
    for raw in lines:
        length = len(raw) + 1
        state.lines += 1
        number = state.lines
        try:
            f = fields_of(raw)
        except LineError as exc:
            _break(state, number, f"line {number}: not a valid chained record (edited or corrupted): {exc}")
            state.next_seq += 1
        else:
            if state.broken_line is None:
                _check_link(state, number, f.seq, f.prev, f.recorded, f.computed, f.kind)
            state.next_seq = (f.seq if f.seq is not None else state.next_seq) + 1
            state.last_hash = f.recorded
            if f.final:
                state.sealed = True
            append((fid, offset, length, number, -1 if f.seq is None else f.seq, f.recorded,
                    state.broken_line is None, f.time_ns, f.kind, f.request_id, f.request_hash, f.sandbox, f.host,
                    f.decision, f.reason, f.rule, f.trigger, None if f.computed == f.recorded else f.computed))
        if number == 1:
            state.head_sha, state.head_len = _sha(data[offset - base : offset - base + length]), length
        state.tail_off = offset
        offset += length
    state.tail_sha = _sha(data[state.tail_off - base : end])
    state.indexed_size = base + end
    return rows


def _check_link(state: FileState, number: int, seq: int | None, prev: str | None, recorded: str, computed: str,
                kind: str) -> None:
    where = f"line {number} (seq {seq})"
    if computed != recorded:
        _break(state, number, f"{where}: record edited (its content does not match its chain hash)")
    elif seq != state.next_seq:
        _break(state, number, f"{where}: expected seq {state.next_seq} (records removed, reordered or inserted)")
    elif seq == 0:
        state.first_prev = prev
        if kind != OP_CHAIN_START:
            _break(state, number, f"{where}: first record is not a chain_start record (records removed)")
    elif prev != state.last_hash:
        _break(state, number, f"{where}: chain.prev does not match the previous record's hash "
                              f"(record seq {state.next_seq - 1} was edited and re-hashed, or replaced)")
    elif state.sealed:
        _break(state, number, f"{where}: record after the final checkpoint (appended after the file was sealed)")


def _break(state: FileState, number: int, reason: str) -> None:
    if state.broken_line is None:
        state.broken_line, state.broken_reason = number, reason
