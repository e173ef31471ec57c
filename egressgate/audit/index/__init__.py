"""The audit index: SQLite over the JSONL audit files (docs/audit.md, "Index"). The files stay the record of
truth; the index is derived, rebuildable and checked against the hash chain."""

from egressgate.audit.index.follower import IndexFollower
from egressgate.audit.index.model import FileCheck, Hit, IndexBusy, IndexStale, IndexStats, Stats, VerifyReport
from egressgate.audit.index.query import normalize_hash
from egressgate.audit.index.store import AuditIndex

__all__ = ["AuditIndex", "FileCheck", "Hit", "IndexBusy", "IndexFollower", "IndexStale", "IndexStats", "Stats",
           "VerifyReport", "normalize_hash"]
