"""`AuditIndex`: an SQLite index over JSONL audit files (by request id, request hash, sandbox, host, reason,
rule, time), built incrementally, verified against the hash chain, never trusted over the files.

One writer at a time (an `flock` on `<db>.lock`: the admin server's follower and `egressgate audit index`
may run at once), any number of readers (WAL). Connections are per thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import multiprocessing
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from egressgate.audit.index import query
from egressgate.audit.index.extract import LineError, chain_hashes
from egressgate.audit.index.model import FileCheck, Hit, IndexBusy, IndexStale, IndexStats, Stats, VerifyReport
from egressgate.audit.index.scan import FILE_COLUMNS, FileState, changed, first_line_sha, scan
from egressgate.audit.index.schema import INSERT_RECORD, connect, create_db_file, ensure_schema

# constant column names only (noqa: S608)
log = logging.getLogger(__name__)
_FILE_SELECT = f"SELECT {', '.join(FILE_COLUMNS)} FROM files"  # noqa: S608
_FILE_UPSERT = (f"INSERT OR REPLACE INTO files({', '.join(FILE_COLUMNS)}) "  # noqa: S608
                f"VALUES ({', '.join('?' * len(FILE_COLUMNS))})")


# A backlog at least this large is parsed by `workers` processes (when workers > 1): below it, starting the
# processes costs more than it saves.
PARALLEL_MIN_BYTES = 16 << 20


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction (BEGIN IMMEDIATE: the write lock up front, no upgrade deadlock with a reader)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


class AuditIndex:
    def __init__(self, db_path: str | Path, *, workers: int = 1) -> None:
        """`workers` > 1: big backlogs (a first build) are parsed and hashed by that many processes (the
        chain is still checked in order, here). The gateway's follower keeps 1: no processes in a server."""
        self.db_path = Path(db_path)
        self.workers = max(1, workers)
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        # paths whose bytes record() found changed: rebuilt by the next add_files. Also persisted in the
        # database (`stale_files`, _mark_stale): the next writer may be another process (`audit index`).
        self._stale: set[str] = set()
        create_db_file(self.db_path)
        ensure_schema(self._conn())

    # --- connections and the writer lock --------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.db_path)
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def close(self) -> None:
        with self._conns_lock:
            for conn in self._conns:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._conns.clear()
        self._local = threading.local()

    def __enter__(self) -> AuditIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _writer(self, wait: bool) -> Iterator[sqlite3.Connection]:
        """Hold the index's writer lock: two writers would index the same lines twice."""
        fd = os.open(self.db_path.with_name(self.db_path.name + ".lock"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                raise IndexBusy(f"another process is writing the audit index {self.db_path}") from None
            yield self._conn()
        finally:
            os.close(fd)

    def _files(self, conn: sqlite3.Connection) -> dict[str, FileState]:
        return {row[1]: FileState(*row[:14], bool(row[14]), row[15]) for row in conn.execute(_FILE_SELECT)}

    # --- building -------------------------------------------------------------------------------------

    def add_files(self, paths: Sequence[str | Path], *, wait: bool = True) -> IndexStats:
        """Index what is new in `paths` (absolute paths are stored). A file seen before resumes at the stored
        offset; one replaced, truncated or edited (first or last indexed line) is re-indexed from byte 0; a
        file renamed by rotation (same device, inode and first line) keeps its rows under its new name."""
        started = time.perf_counter()
        stats = IndexStats()
        opened: dict[str, tuple[int, os.stat_result]] = {}
        try:
            for p in paths:
                path = os.path.abspath(p)
                if path in opened:
                    continue
                try:  # O_NONBLOCK: a FIFO given by mistake must not hang the indexer
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                except FileNotFoundError:
                    continue  # rotated away between listing and opening: found under its new name next time
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    os.close(fd)
                    log.warning("audit index: %s is not a regular file; skipped", path)
                    continue
                opened[path] = (fd, st)
            with self._writer(wait) as conn:
                known = self._files(conn)
                self._follow_renames(conn, known, opened, stats)
                backlog = sum(st.st_size - (known[p].indexed_size if p in known else 0)
                              for p, (_, st) in opened.items())
                with self._pool(backlog) as pool:
                    for path, (fd, st) in opened.items():
                        self._index_file(conn, known.get(path), path, fd, st, stats, pool)
        finally:
            for fd, _ in opened.values():
                os.close(fd)
        stats.files = len(opened)
        stats.seconds = time.perf_counter() - started
        return stats

    def _follow_renames(self, conn: sqlite3.Connection, known: dict[str, FileState],
                        opened: dict[str, tuple[int, os.stat_result]], stats: IndexStats) -> None:
        """A rotated file is the same inode under a new name: move its rows instead of re-reading it."""
        by_identity = {(st.st_dev, st.st_ino): path for path, (_, st) in opened.items()}
        for state in list(known.values()):
            target = by_identity.get((state.dev, state.ino))
            if target is None or target == state.path or known.get(state.path) is not state:
                continue
            fd = opened[target][0]
            if state.head_sha is None or first_line_sha(fd, state.head_len) != state.head_sha:
                continue
            with _transaction(conn):
                old = known.pop(target, None)
                if old is not None:
                    self._drop(conn, old)
                conn.execute("UPDATE files SET path = ? WHERE id = ?", (target, state.id))
            stats.renamed.append(f"{state.path} -> {target}")
            known.pop(state.path, None)
            self._stale.discard(state.path)
            state.path = target
            known[target] = state

    @staticmethod
    def _drop(conn: sqlite3.Connection, state: FileState) -> None:
        conn.execute("DELETE FROM records WHERE file_id = ?", (state.id,))
        conn.execute("DELETE FROM stale_files WHERE file_id = ?", (state.id,))
        conn.execute("DELETE FROM files WHERE id = ?", (state.id,))

    def _mark_stale(self, path: str, reason: str) -> None:
        """Remember that `path`'s rows no longer match its bytes, in memory and in the database, so the next
        add_files — of this process or of the next `audit index` — re-indexes it from byte 0. A reader that
        cannot write the database (read-only copy, busy past the timeout) keeps the in-memory mark and says so."""
        self._stale.add(path)
        try:
            self._conn().execute("INSERT OR REPLACE INTO stale_files(file_id, reason) "
                                 "SELECT id, ? FROM files WHERE path = ?", (reason, path))
        except sqlite3.Error as exc:
            log.warning("audit index: could not mark %s for re-indexing in %s (%s); the next `audit index "
                        "--verify` finds it", path, self.db_path, exc)

    @staticmethod
    def _stale_reason(conn: sqlite3.Connection, state: FileState) -> str | None:
        row = conn.execute("SELECT reason FROM stale_files WHERE file_id = ?", (state.id,)).fetchone()
        return None if row is None else str(row[0])

    @contextlib.contextmanager
    def _pool(self, backlog: int) -> Iterator[Executor | None]:
        if self.workers < 2 or backlog < PARALLEL_MIN_BYTES:
            yield None
            return
        # forkserver, not fork: the caller may have threads (a fork would copy their locks mid-use)
        context = multiprocessing.get_context("forkserver")
        with ProcessPoolExecutor(max_workers=self.workers, mp_context=context) as pool:
            yield pool

    def _index_file(self, conn: sqlite3.Connection, state: FileState | None, path: str, fd: int,
                    st: os.stat_result, stats: IndexStats, pool: Executor | None = None) -> None:
        if state is not None:
            marked = self._stale_reason(conn, state)
            why = ("a record read back did not match the indexed bytes" + (f" ({marked})" if marked else "")
                   if path in self._stale or marked is not None else changed(fd, st, state))
            if why:
                with _transaction(conn):
                    self._drop(conn, state)
                stats.rebuilt.append(f"{path}: {why}")
                state = None
            self._stale.discard(path)
        if state is None:
            state = FileState(None, path, st.st_dev, st.st_ino)
            with _transaction(conn):
                state.id = conn.execute(_FILE_UPSERT, state.as_row()).lastrowid
        was_broken = state.broken_line is not None
        try:
            self._store(conn, scan(fd, state, st.st_size, pool), state, stats)
        except BrokenProcessPool as exc:  # e.g. a __main__ the workers cannot import: go on in this process
            log.warning("audit index: worker processes failed (%s); indexing %s in this process", exc, path)
            self._store(conn, scan(fd, state, st.st_size, None), state, stats)
        if state.broken_line is not None and not was_broken:
            stats.broken.append(f"{path}: {state.broken_reason}")

    @staticmethod
    def _store(conn: sqlite3.Connection, steps: Iterator[tuple[list[tuple], int]], state: FileState,
               stats: IndexStats) -> None:
        """Commit each step's rows with the file's new state (one transaction: a crash never leaves rows
        without the offset that says they are there, nor the reverse)."""
        for rows, partial in steps:
            stats.partial_bytes += partial
            if not rows and partial:
                break
            with _transaction(conn):
                conn.executemany(INSERT_RECORD, rows)
                conn.execute(_FILE_UPSERT, state.as_row())
            stats.added += len(rows)

    # --- reading --------------------------------------------------------------------------------------

    def find(self, *, request_id: str | None = None, request_hash: str | None = None, sandbox: str | None = None,
             host: str | None = None, reason: str | None = None, rule: str | None = None,
             decision: str | None = None, kind: str | None = None, trigger: str | None = None,
             since_ns: int | None = None, until_ns: int | None = None, files: Sequence[str | Path] | None = None,
             limit: int = 100, before_rowid: int | None = None) -> list[Hit]:
        """Records matching every given filter, newest indexed first (page with `before_rowid`)."""
        sql, params = query.find_sql(
            request_id=request_id, request_hash=request_hash, sandbox=sandbox, host=host, reason=reason,
            rule=rule, decision=decision, kind=kind, trigger=trigger, since_ns=since_ns, until_ns=until_ns,
            files=None if files is None else [os.path.abspath(f) for f in files], limit=limit,
            before_rowid=before_rowid)
        return [query.hit(row) for row in self._conn().execute(sql, params)]

    def record_line(self, hit: Hit) -> bytes:
        """The line (without newline) read back from the JSONL file at `hit.offset`, re-checked: the same file
        (device, inode), a whole line, the chain hash and the recomputed hash seen when indexing. Only a row
        of the index can be read (rowid, file and offset must match one): a Hit built from a request's input
        cannot name another file or offset.
        Raises IndexStale (the file is then re-indexed by the next add_files)."""
        conn = self._conn()
        row = conn.execute("SELECT f.dev, f.ino, r.computed FROM records r JOIN files f ON f.id = r.file_id "
                           "WHERE r.id = ? AND f.path = ? AND r.offset = ?", (hit.rowid, hit.file, hit.offset)
                           ).fetchone()
        if row is None:
            raise IndexStale(f"{hit.file} line {hit.line}: no longer in the index (re-indexed since); search again")
        dev, ino, computed_then = row
        try:
            data = self._read_at(hit, dev, ino)
            recorded, computed = chain_hashes(data)
        except (OSError, LineError, IndexStale) as exc:
            self._mark_stale(hit.file, f"line {hit.line}: {exc}")
            raise IndexStale(f"{hit.file} line {hit.line}: {exc}") from None
        if recorded != hit.record_hash or computed != (computed_then or recorded):
            self._mark_stale(hit.file, f"line {hit.line} changed")
            raise IndexStale(f"{hit.file} line {hit.line}: the record changed since it was indexed (edited); "
                             "the index will re-read this file")
        return data

    def record(self, hit: Hit) -> dict:
        """The raw OTLP/JSON record of `hit`, read back from the JSONL file and re-checked (record_line)."""
        return json.loads(self.record_line(hit))

    @staticmethod
    def _read_at(hit: Hit, dev: int, ino: int) -> bytes:
        fd = os.open(hit.file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise IndexStale("a different file now has this name")
            start = hit.offset - 1 if hit.offset else 0
            data = os.pread(fd, hit.length + (hit.offset - start), start)
        finally:
            os.close(fd)
        if hit.offset and data[:1] != b"\n":
            raise IndexStale("the record no longer starts at the indexed offset")
        data = data[hit.offset - start :]
        if len(data) != hit.length or not data.endswith(b"\n") or b"\n" in data[:-1]:
            raise IndexStale("the record no longer has the indexed length")
        return data[:-1]

    def stats(self, *, since_ns: int, until_ns: int, bucket_s: int, top: int = 10) -> Stats:
        """Denies by reason per `bucket_s` bucket over [since_ns, until_ns), and the `top` most denied hosts."""
        return query.deny_stats(self._conn(), since_ns, until_ns, bucket_s, top)

    # --- verification ---------------------------------------------------------------------------------

    def verify(self) -> VerifyReport:
        """Re-read every indexed file and compare each line with its row; a file whose bytes changed is
        re-indexed (reported). Also checks the links between the files of each chain (rotation order)."""
        report = VerifyReport()
        with self._writer(True) as conn:
            for state in list(self._files(conn).values()):
                check = FileCheck(state.path)
                report.files.append(check)
                try:
                    fd = os.open(state.path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    check.missing = True
                    with _transaction(conn):
                        self._drop(conn, state)
                    continue
                try:
                    st = os.fstat(fd)
                    why = changed(fd, st, state) or self._differs(conn, fd, state)
                    if not why and self._stale_reason(conn, state) is not None:  # the bytes are back as indexed
                        with _transaction(conn):
                            conn.execute("DELETE FROM stale_files WHERE file_id = ?", (state.id,))
                        self._stale.discard(state.path)
                    if why:
                        check.rebuilt = why
                        stats = IndexStats()
                        with _transaction(conn):
                            self._drop(conn, state)
                        self._index_file(conn, None, state.path, fd, st, stats)
                finally:
                    os.close(fd)
            final = self._files(conn)
        for check in report.files:
            state = final.get(check.path)
            if state is None:
                continue
            check.records, check.verified = conn.execute(
                "SELECT count(*), coalesce(sum(verified), 0) FROM records WHERE file_id = ?", (state.id,)).fetchone()
            check.broken = state.broken_reason
        report.links = query.chain_links(final.values())
        return report

    def _differs(self, conn: sqlite3.Connection, fd: int, state: FileState) -> str | None:
        """First line whose bytes no longer match its row (a same-length edit in the middle)."""
        fresh = FileState(state.id, state.path, state.dev, state.ino)
        stored = conn.execute("SELECT offset, length, line, record_hash, computed FROM records WHERE file_id = ? "
                              "ORDER BY id", (state.id,))
        for rows, _ in scan(fd, fresh, state.indexed_size):
            for row in rows:
                want = stored.fetchone()
                got = (row[1], row[2], row[3], row[5], row[17])
                if want is None or tuple(want) != got:
                    return f"line {row[3]} changed since it was indexed"
        if stored.fetchone() is not None or fresh.indexed_size != state.indexed_size:
            return "lines changed since they were indexed"
        return None
