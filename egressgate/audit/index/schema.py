"""The SQLite schema of the audit index, and how connections are opened.

Why SQLite in WAL mode: one embedded file, no server; readers (the console, `audit find`) never block the
one writer (the admin server's follower or `egressgate audit index`) and see a consistent snapshot.
The index is derived data: a schema from another version is dropped and rebuilt, never migrated.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

SCHEMA_VERSION = 1

# `stale_files`: files a reader found changed under its rows (`AuditIndex.record_line`), kept in the database so
# the next writer re-indexes them whichever process it is (a mark in the reader's memory died with `audit find`).
# `computed` is NULL unless the line's recomputed chain hash differs from the one it carries (an edited
# record): `record()` re-checks the bytes against exactly what was seen when indexing.
_DDL = """
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY, path TEXT NOT NULL UNIQUE, dev INTEGER NOT NULL, ino INTEGER NOT NULL,
    head_sha TEXT, head_len INTEGER NOT NULL, indexed_size INTEGER NOT NULL, lines INTEGER NOT NULL,
    next_seq INTEGER NOT NULL, last_hash TEXT, tail_off INTEGER NOT NULL, tail_sha TEXT, broken_line INTEGER,
    broken_reason TEXT, sealed INTEGER NOT NULL, first_prev TEXT
);
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY, file_id INTEGER NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL,
    line INTEGER NOT NULL, chain_index INTEGER NOT NULL, record_hash TEXT NOT NULL, verified INTEGER NOT NULL,
    time_ns INTEGER NOT NULL, kind TEXT NOT NULL, request_id TEXT, request_hash TEXT, sandbox TEXT, host TEXT,
    decision TEXT, reason TEXT, rule TEXT, trigger TEXT, computed TEXT
);
CREATE TABLE IF NOT EXISTS stale_files (file_id INTEGER PRIMARY KEY, reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS records_file ON records(file_id, line);
CREATE INDEX IF NOT EXISTS records_request_id ON records(request_id) WHERE request_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS records_request_hash ON records(request_hash) WHERE request_hash IS NOT NULL;
CREATE INDEX IF NOT EXISTS records_trigger ON records(trigger) WHERE trigger IS NOT NULL;
CREATE INDEX IF NOT EXISTS records_time ON records(time_ns);
CREATE INDEX IF NOT EXISTS records_sandbox ON records(sandbox, time_ns) WHERE sandbox IS NOT NULL;
CREATE INDEX IF NOT EXISTS records_host ON records(host) WHERE host IS NOT NULL;
CREATE INDEX IF NOT EXISTS records_deny ON records(time_ns, reason, host) WHERE decision = 'deny';
"""

RECORD_COLUMNS = ("file_id", "offset", "length", "line", "chain_index", "record_hash", "verified", "time_ns", "kind",
                  "request_id", "request_hash", "sandbox", "host", "decision", "reason", "rule", "trigger",
                  "computed")
INSERT_RECORD = (f"INSERT INTO records({', '.join(RECORD_COLUMNS)}) "  # noqa: S608 - constant column names
                 f"VALUES ({', '.join('?' * len(RECORD_COLUMNS))})")


def create_db_file(path: Path) -> None:
    """Create the database 0600 before SQLite does (it would use the umask): the index holds every host,
    path and sandbox of the audit trail. SQLite gives its -wal/-shm files the database file's mode."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    conn.execute("PRAGMA busy_timeout=30000")
    conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints; the index is rebuildable anyway
    conn.execute("PRAGMA cache_size=-65536")
    conn.execute("PRAGMA temp_store=MEMORY")
    return conn


def ensure_schema(conn: sqlite3.Connection) -> None:
    """Create the schema (WAL mode); drop an index written by another schema version (it is derived)."""
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            conn.execute("DROP TABLE IF EXISTS records")
            conn.execute("DROP TABLE IF EXISTS files")
        for statement in _DDL.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
