"""The retry queue's copy on disk: after-the-fact records (outcomes) that could not be written to the audit
file are also appended here, so a gateway killed while they wait does not lose them; the next start writes
them into the new chain first.

Why a separate file (default `<var_dir>/audit-retry.jsonl`): the usual reason a write fails is that the
audit volume is full or gone; the spool is meant to live elsewhere. If it cannot be written either, the
record stays queued in memory and the log says so (it is still retried, and named if finally lost).
A record is removed from the spool only after it is in the audit file; a crash between the two writes it
twice (same request id) rather than losing it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from egressgate.audit.encode import encode_record
from egressgate.audit.record import Record, RecordFormatError, parse_line

log = logging.getLogger("egressgate.audit.filesink")
CHAIN_PREFIX = "egressgate.chain."


class RetrySpool:
    def __init__(self, path: Path | None) -> None:
        self.path = path

    def load(self) -> list[Record]:
        """Records a previous run left queued (a partial last line is dropped: it was never complete)."""
        if self.path is None or not self.path.is_file():
            return []
        out = []
        for raw in self.path.read_bytes().split(b"\n"):
            if not raw.strip():
                continue
            try:
                rec = parse_line(raw)
            except RecordFormatError:
                log.error("unreadable line in the audit retry spool %s skipped", self.path)
                continue
            rec.attributes["egressgate.retry.after_restart"] = True
            out.append(rec)
        return out

    def add(self, record: Record) -> bool:
        if self.path is None:
            return False
        plain = Record(record.time_ns, record.severity_number, record.severity_text, record.event_name,
                       record.body, {k: v for k, v in record.attributes.items() if not k.startswith(CHAIN_PREFIX)})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                data = memoryview(encode_record(plain) + b"\n")
                while data:
                    data = data[os.write(fd, data) :]
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("audit retry spool %s not writable (%s): the queued record is kept in memory only",
                      self.path, exc)
            return False
        return True

    def clear(self) -> None:
        """Every queued record is now in the audit file."""
        if self.path is not None and self.path.exists():
            try:
                os.truncate(self.path, 0)
            except OSError as exc:
                log.error("audit retry spool %s could not be emptied (%s): its records may be written "
                          "twice at the next start", self.path, exc)
