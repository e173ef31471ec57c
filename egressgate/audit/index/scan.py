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
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from egressgate.audit.chain import OP_CHAIN_START
from egressgate.audit.index.extract import LineError, chain_hashes, values_of

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


def chunks(fd: int, start: int, until: int) -> Iterator[tuple[int, bytes, int]]:
    """(file offset, complete lines, 0) steps between `start` and `until`; last, (offset, b"", n) when an
    incomplete line of n bytes remains (a writer mid-append: it is indexed next time, whole)."""
    chunk = CHUNK
    pos = start
    while pos < until:
        data = os.pread(fd, min(chunk, until - pos), pos)
        if not data:
            return
        end = data.rfind(b"\n") + 1
        if end == 0:
            if pos + len(data) >= until:
                yield pos, b"", len(data)
                return
            chunk *= 2  # one line longer than a chunk
            continue
        yield pos, data[:end], 0
        pos += end
        chunk = CHUNK


def parse_lines(data: bytes) -> list[tuple]:
    """Per line of `data` (complete lines): (length, recorded hash, computed hash, *extract.SLOTS values), or
    (length, why) for a line that is not a chained record. Pure: runs in worker processes for big builds."""
    out: list[tuple] = []
    append = out.append
    for raw in data[:-1].split(b"\n"):
        try:
            append((len(raw) + 1, *chain_hashes(raw), *values_of(raw)))
        except LineError as exc:
            append((len(raw) + 1, str(exc)))
    return out


def parse_range(source: str, dev: int, ino: int, offset: int, length: int) -> list[tuple] | None:
    """parse_lines() of bytes [offset, offset+length) of the file open in the indexing process, read here
    (`source` is its /proc/PID/fd/N: the same inode, whatever now has the file's name) so that the chunk is
    not copied through a pipe. None when it is not that file any more."""
    fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino):
            return None
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    return parse_lines(data) if len(data) == length else None


def _parsed(future: Future, data: bytes) -> list[tuple]:
    """A worker's result for `data`, or the same parse done here when the worker read other bytes (the file
    changed in place meanwhile): rows must describe the bytes this process hashes for the file's state."""
    parsed = future.result()
    if parsed is None or sum(item[0] for item in parsed) != len(data):
        return parse_lines(data)
    return parsed


def scan(fd: int, state: FileState, until: int, pool: Executor | None = None) -> Iterator[tuple[list[tuple], int]]:
    """Index the complete lines between `state.indexed_size` and `until` (the size seen at open), one chunk
    at a time: yields (rows, partial bytes left) after updating `state`; the caller commits both. With a
    process `pool`, lines are parsed and hashed in parallel; the chain is still checked here, in order."""
    steps = chunks(fd, state.indexed_size, until)
    if pool is None:
        for base, data, partial in steps:
            if partial:
                yield [], partial
                return
            yield apply(state, parse_lines(data), data, base), 0
        return
    pending: deque[tuple[int, bytes, Future]] = deque()
    partial = 0
    depth = 2 * getattr(pool, "_max_workers", 2)
    source = f"/proc/{os.getpid()}/fd/{fd}"
    for base, data, partial in steps:
        if partial:
            break
        pending.append((base, data, pool.submit(parse_range, source, state.dev, state.ino, base, len(data))))
        if len(pending) > depth:
            base, data, future = pending.popleft()
            yield apply(state, _parsed(future, data), data, base), 0
    while pending:
        base, data, future = pending.popleft()
        yield apply(state, _parsed(future, data), data, base), 0
    if partial:
        yield [], partial


def apply(state: FileState, parsed: list[tuple], data: bytes, base: int) -> list[tuple]:
    """Check the chain of parsed lines (in file order) and build their rows (schema.RECORD_COLUMNS order)."""
    assert base == state.indexed_size, "chunks are applied in file order"
    rows: list[tuple] = []
    append = rows.append
    fid = state.id
    offset = base
    number = state.lines
    for item in parsed:
        length = item[0]
        number += 1
        if len(item) == 2:
            _break(state, number, f"line {number}: not a valid chained record (edited or corrupted): {item[1]}")
            state.next_seq += 1
        else:
            _, recorded, computed, seq, prev, time_ns, kind, rid, rhash, sandbox, host, decision, reason, rule, \
                trigger, final = item
            if state.broken_line is None and not (  # the common case, inline; _check_link says why not
                    computed == recorded and seq == state.next_seq and not state.sealed
                    and (prev == state.last_hash if seq else kind == OP_CHAIN_START)):
                _check_link(state, number, seq, prev, recorded, computed, kind)
            if number == 1:
                state.first_prev = prev
            state.next_seq = (state.next_seq if seq is None else seq) + 1
            state.last_hash = recorded
            if final:
                state.sealed = True
            append((fid, offset, length, number, -1 if seq is None else seq, recorded, state.broken_line is None,
                    time_ns, kind, rid, rhash, sandbox, host, decision, reason, rule, trigger,
                    None if computed == recorded else computed))
        if number == 1:
            state.head_sha, state.head_len = _sha(data[offset - base : offset - base + length]), length
        state.tail_off = offset
        offset += length
    state.lines = number
    state.tail_sha = _sha(data[state.tail_off - base :])
    state.indexed_size = base + len(data)
    return rows


def _check_link(state: FileState, number: int, seq: int | None, prev: str | None, recorded: str, computed: str,
                kind: str) -> None:
    where = f"line {number} (seq {seq})"
    if computed != recorded:
        _break(state, number, f"{where}: record edited (its content does not match its chain hash)")
    elif seq != state.next_seq:
        _break(state, number, f"{where}: expected seq {state.next_seq} (records removed, reordered or inserted)")
    elif seq == 0:
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
