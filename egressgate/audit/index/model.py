"""What the audit index returns: hits, build statistics, deny statistics and verification reports."""

from __future__ import annotations

from dataclasses import dataclass, field


class IndexStale(RuntimeError):
    """The JSONL bytes no longer match what was indexed (the file was edited, truncated or replaced): the
    index must not be trusted for this file until it is rebuilt (`add_files` does it)."""


class IndexBusy(RuntimeError):
    """Another process is writing this index (one writer, many readers)."""


@dataclass(slots=True)
class Hit:
    """One indexed record. `verified`: the chain link of this record (its own hash and its link to the
    previous record, back to its file's chain_start) was checked while indexing; signatures are
    `audit verify`'s job. `record(hit)` re-reads the bytes at `offset` and re-checks them."""

    file: str
    offset: int
    line: int
    chain_index: int
    record_hash: str
    verified: bool
    time_ns: int
    kind: str
    request_id: str | None
    request_hash: str | None
    sandbox: str | None
    host: str | None
    decision: str | None
    reason: str | None
    rule: str | None
    rowid: int = 0  # for paging: find(before_rowid=hits[-1].rowid)
    length: int = 0  # bytes of the line, newline included
    trigger: str | None = None  # egressgate.trigger_request (credential records name the request they served)


@dataclass(slots=True)
class IndexStats:
    """What one `add_files` did."""

    files: int = 0
    added: int = 0  # records indexed by this call
    rebuilt: list[str] = field(default_factory=list)  # "path: why" for every file whose rows were dropped
    renamed: list[str] = field(default_factory=list)  # "old -> new": same file (rotation), rows kept
    broken: list[str] = field(default_factory=list)  # "path: line N: why" for chains found broken by this call
    partial_bytes: int = 0  # bytes of incomplete last lines, left for the next call
    seconds: float = 0.0


@dataclass(slots=True)
class Stats:
    """Denies by reason per time bucket, and the most denied hosts, over [since_ns, until_ns)."""

    since_ns: int
    until_ns: int
    bucket_s: int
    buckets: list[dict] = field(default_factory=list)  # [{"t": bucket start ns, "by_reason": {reason: n}}]
    top_denied_hosts: list[dict] = field(default_factory=list)  # [{"host": h, "count": n}]


@dataclass(slots=True)
class FileCheck:
    path: str
    records: int = 0
    verified: int = 0
    broken: str | None = None  # "line N: why" (first break of the chain in this file)
    rebuilt: str | None = None  # why the file's rows were rebuilt during verify (bytes changed), or None
    missing: bool = False  # the file is gone: its rows were dropped


@dataclass(slots=True)
class VerifyReport:
    files: list[FileCheck] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # cross-file breaks: "b does not continue a"

    @property
    def ok(self) -> bool:
        return not self.links and all(f.broken is None and f.rebuilt is None and not f.missing for f in self.files)
