"""The read queries of the audit index: search, deny statistics, and the links between a chain's files.

Every value from the caller is a bound parameter (never formatted into SQL): they come from the console's
query string.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path

from egressgate.audit.chain import GENESIS
from egressgate.audit.filewatch import chain_name
from egressgate.audit.index.model import Hit, Stats
from egressgate.audit.index.scan import FileState

MAX_LIMIT = 10_000
MAX_BUCKETS = 10_000

_HIT_COLUMNS = ("f.path, r.offset, r.line, r.chain_index, r.record_hash, r.verified, r.time_ns, r.kind, r.request_id, "
                "r.request_hash, r.sandbox, r.host, r.decision, r.reason, r.rule, r.id, r.length, r.trigger")


def normalize_hash(request_hash: str) -> str:
    """`sha256:<hex>` as recorded; a bare hex digest or upper case is accepted (audit/find.py does the same)."""
    value = request_hash.strip().lower()
    return value if value.startswith("sha256:") else "sha256:" + value


def find_sql(*, request_id: str | None, request_hash: str | None, sandbox: str | None, host: str | None,
             reason: str | None, rule: str | None, decision: str | None, kind: str | None, trigger: str | None,
             since_ns: int | None, until_ns: int | None, files: Sequence[str] | None, limit: int,
             before_rowid: int | None) -> tuple[str, list]:
    where: list[str] = []
    params: list = []
    for column, value in (("r.request_id", request_id), ("r.sandbox", sandbox), ("r.host", host),
                          ("r.reason", reason), ("r.rule", rule), ("r.decision", decision), ("r.kind", kind),
                          ("r.trigger", trigger)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if request_hash is not None:
        where.append("r.request_hash = ?")
        params.append(normalize_hash(request_hash))
    if since_ns is not None:
        where.append("r.time_ns >= ?")
        params.append(int(since_ns))
    if until_ns is not None:
        where.append("r.time_ns < ?")
        params.append(int(until_ns))
    if before_rowid is not None:
        where.append("r.id < ?")
        params.append(int(before_rowid))
    if files is not None:
        where.append(f"f.path IN ({', '.join('?' * len(files))})" if files else "0")
        params.extend(files)
    limit = max(0, min(int(limit), MAX_LIMIT))
    # constant column names and "?" placeholders only: every value is a bound parameter
    clause = " WHERE " + " AND ".join(where) if where else ""
    sql = f"SELECT {_HIT_COLUMNS} FROM records r JOIN files f ON f.id = r.file_id{clause} ORDER BY r.id DESC LIMIT ?"  # noqa: S608
    return sql, [*params, limit]


def hit(row: sqlite3.Row | tuple) -> Hit:
    (path, offset, line, chain_index, record_hash, verified, time_ns, kind, request_id, request_hash, sandbox, host,
     decision, reason, rule, rowid, length, trigger) = row
    return Hit(path, offset, line, chain_index, record_hash, bool(verified), time_ns, kind, request_id, request_hash,
               sandbox, host, decision, reason, rule, rowid, length, trigger)


def deny_stats(conn: sqlite3.Connection, since_ns: int, until_ns: int, bucket_s: int, top: int) -> Stats:
    if bucket_s <= 0 or until_ns <= since_ns:
        raise ValueError("need bucket_s > 0 and until_ns > since_ns")
    width = int(bucket_s) * 1_000_000_000
    count = -(-(until_ns - since_ns) // width)
    if count > MAX_BUCKETS:
        raise ValueError(f"{count} buckets: widen the bucket or narrow the time range (at most {MAX_BUCKETS})")
    stats = Stats(since_ns, until_ns, bucket_s)
    stats.buckets = [{"t": since_ns + i * width, "by_reason": {}} for i in range(count)]
    rows = conn.execute(
        "SELECT (time_ns - ?) / ?, coalesce(reason, ''), count(*) FROM records "
        "WHERE decision = 'deny' AND time_ns >= ? AND time_ns < ? GROUP BY 1, 2",
        (since_ns, width, since_ns, until_ns))
    for bucket, reason, n in rows:
        stats.buckets[bucket]["by_reason"][reason] = n
    stats.top_denied_hosts = [
        {"host": host, "count": n}
        for host, n in conn.execute(
            "SELECT host, count(*) FROM records WHERE decision = 'deny' AND time_ns >= ? AND time_ns < ? "
            "AND host IS NOT NULL GROUP BY host ORDER BY 2 DESC, host LIMIT ?", (since_ns, until_ns, max(0, top)))
    ]
    return stats


def chain_links(files: Iterable[FileState]) -> list[str]:
    """Consecutive files of one chain (rotated files by their time stamp, the live file last, as
    `audit verify --per-worker` orders them) must link: each seq 0's prev is the previous file's last hash
    (a new chain, prev = 64 "0", is `audit verify`'s warning, not a break)."""
    chains: dict[str, list[FileState]] = {}
    for state in files:
        p = Path(state.path)
        chains.setdefault(str(p.parent / chain_name(p)), []).append(state)
    problems = []
    for members in chains.values():
        members.sort(key=lambda s: (Path(s.path).name == chain_name(Path(s.path)), Path(s.path).name))
        for a, b in itertools.pairwise(members):
            if b.first_prev not in (None, GENESIS) and a.last_hash is not None and b.first_prev != a.last_hash:
                problems.append(f"{b.path} does not continue {a.path}: a file is missing between them, or the "
                                "previous file was altered")
    return problems
