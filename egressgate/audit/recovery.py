"""What a previous run left in the audit file, so a restart can seal a file a crash left open.

Why seal at restart: after `kill -9` (or a power loss) the file has no final checkpoint, and `audit verify`
over the whole history used to fail there for ever. At start the sink appends a signed `recovery`
checkpoint that states the crash (the signed kind is `recovery`, so it cannot pass for a clean close).

Why check the tail first: the records after the last signed checkpoint were never signed; signing them
at restart without looking would launder an edit made while the gateway was down. The tail is checked
line by line (hashes, links, seq); a tail that does not verify is *not* signed, and the incident is
recorded in the new file, so `verify` still points at the edit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from egressgate.audit.chain import (
    K_CP_FINAL,
    K_CP_SIG,
    OP_CHAIN_START,
    OP_CHECKPOINT,
    compute_line_hash,
    recorded_line_hash,
)
from egressgate.audit.record import K_CHAIN_PREV, K_CHAIN_SEQ, K_OPERATION, RecordFormatError, parse_line


@dataclass(slots=True)
class TailState:
    complete_size: int  # bytes up to the end of the last complete line
    partial: int  # bytes of an incomplete last line (never acknowledged to anyone)
    last_seq: int
    last_hash: str
    last_time_ns: int
    sealed: bool  # the last line is a final checkpoint (signed or deferred)
    since_signed: int  # lines after the last signed checkpoint
    problem: str | None  # the unsigned tail does not verify: it must not be signed


def inspect_tail(path: Path) -> TailState | None:
    """None when the file holds no complete line. Reads the file once (it is at most one rotation size)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    partial = len(data) - end
    lines = data[:end].split(b"\n")[:-1]
    if not lines:
        return None
    # walk back to the last signed checkpoint: everything after it was never signed
    anchor = -1
    parsed: dict[int, dict] = {}
    problem = None
    for i in range(len(lines) - 1, -1, -1):
        try:
            rec = parse_line(lines[i])
        except RecordFormatError as exc:
            problem = f"line {i + 1}: not a valid record ({exc})"
            break
        parsed[i] = {**rec.attributes, "_time": rec.time_ns}
        if rec.attributes.get(K_OPERATION) == OP_CHECKPOINT and K_CP_SIG in rec.attributes:
            anchor = i
            break
    if problem is None:
        problem = _check_tail(lines, parsed, anchor)
    last = parsed.get(len(lines) - 1, {})
    try:
        last_hash = recorded_line_hash(lines[-1])
    except ValueError:
        last_hash = ""
        problem = problem or f"line {len(lines)}: no chain hash"
    seq = last.get(K_CHAIN_SEQ)
    return TailState(
        complete_size=end,
        partial=partial,
        last_seq=seq if isinstance(seq, int) else -1,
        last_hash=last_hash,
        last_time_ns=int(last.get("_time", 0)),
        sealed=last.get(K_OPERATION) == OP_CHECKPOINT and bool(last.get(K_CP_FINAL)),
        since_signed=len(lines) - 1 - anchor,
        problem=problem,
    )


def _check_tail(lines: list[bytes], parsed: dict[int, dict], anchor: int) -> str | None:
    """The lines after `anchor` (the last signed checkpoint, or -1) must chain: hash, seq, prev."""
    start = anchor + 1
    prev_hash = recorded_line_hash(lines[anchor]) if anchor >= 0 else None
    prev_seq = parsed[anchor].get(K_CHAIN_SEQ) if anchor >= 0 else -1
    for i in range(start, len(lines)):
        a = parsed[i]
        where = f"line {i + 1}"
        if compute_line_hash(lines[i]) != recorded_line_hash(lines[i]):
            return f"{where}: record edited (content does not match its chain hash)"
        if a.get(K_CHAIN_SEQ) != (prev_seq + 1 if isinstance(prev_seq, int) else None):
            return f"{where}: seq {a.get(K_CHAIN_SEQ)} does not follow {prev_seq} (records removed or reordered)"
        if i == 0:
            if a.get(K_OPERATION) != OP_CHAIN_START:
                return f"{where}: first record is not a chain_start"
        elif a.get(K_CHAIN_PREV) != prev_hash:
            return f"{where}: chain.prev does not match the previous record"
        prev_hash, prev_seq = recorded_line_hash(lines[i]), a.get(K_CHAIN_SEQ)
    return None


def append_seal(path: Path, line: bytes, cut_at: int, fsync: bool) -> None:
    """Cut an incomplete last line (it was never acknowledged: its request was never forwarded) and
    append the recovery checkpoint line."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, cut_at)
        os.lseek(fd, cut_at, os.SEEK_SET)
        data = memoryview(line + b"\n")
        while data:
            data = data[os.write(fd, data) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
