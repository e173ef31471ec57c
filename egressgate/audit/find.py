"""`egressgate audit find`: the records of one request across audit files.

A request's decision record carries `egressgate.request.hash`; its outcome record (status, bytes) is linked
only by `egressgate.request.id`, so records sharing the request id of a hash match are returned too, and so
are the credential-issue records whose `egressgate.trigger_request` names that request.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from egressgate.audit.record import Record, RecordFormatError, parse_line

# A credential minted for a request is its own decision (own request id) naming the request it served.
TRIGGER = "egressgate.trigger_request"


@dataclass(slots=True)
class Found:
    path: str
    line: int
    raw: bytes
    record: Record


def iter_records(paths: Sequence[str | Path]) -> Iterator[Found]:
    """Every parseable record of the files, in order (unparseable lines are skipped: use verify)."""
    for path in paths:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                raw = raw.rstrip(b"\n")
                if not raw:
                    continue
                try:
                    yield Found(str(path), number, raw, parse_line(raw))
                except RecordFormatError:
                    continue


def find_records(
    paths: Sequence[str | Path], request_hash: str | None = None, request_id: str | None = None
) -> list[Found]:
    if not request_hash and not request_id:
        raise ValueError("give a request hash or a request id")
    want_hash = request_hash.lower() if request_hash else None
    if want_hash and not want_hash.startswith("sha256:"):
        want_hash = "sha256:" + want_hash
    all_records = list(iter_records(paths))
    ids = {request_id} if request_id else set()
    if want_hash:
        for f in all_records:
            if f.record.attributes.get("egressgate.request.hash") == want_hash:
                rid = f.record.attributes.get("egressgate.request.id")
                if isinstance(rid, str):
                    ids.add(rid)
    return [
        f
        for f in all_records
        if (want_hash and f.record.attributes.get("egressgate.request.hash") == want_hash)
        or f.record.attributes.get("egressgate.request.id") in ids
        or f.record.attributes.get(TRIGGER) in ids
    ]


# --- with the SQLite index (docs/audit.md, "Index") ------------------------------------------------------

INDEX_SUFFIX = ".index.sqlite"


def default_index_path(first_file: str | Path) -> Path:
    """`<first file>.index.sqlite`, named after the trail's live file, so `audit.jsonl`, its rotated
    `audit.<stamp>.jsonl` and the worker chains `audit.w<N>[.<stamp>].jsonl` share `audit.jsonl.index.sqlite`,
    the index the admin server's console keeps (admin/ui/audit_api.py index_path)."""
    from egressgate.audit.filewatch import chain_name

    p = Path(first_file)
    return p.parent / (re.sub(r"\.w\d+(?=\.[^.]*$)", "", chain_name(p)) + INDEX_SUFFIX)


def find_indexed(
    index_db: str | Path, paths: Sequence[str | Path], request_hash: str | None = None, request_id: str | None = None
) -> tuple[list[Found], list[str]]:
    """find_records() through the index: the index is first brought up to date with `paths` (only new lines
    are read), every line printed is read back from the JSONL and re-checked (AuditIndex.record_line), and
    records whose chain link did not verify come with a warning. Raises IndexStale or sqlite3.Error: the
    caller falls back to the scan (the JSONL is the record of truth, the index only makes it fast)."""
    from egressgate.audit.index import AuditIndex

    if not request_hash and not request_id:
        raise ValueError("give a request hash or a request id")
    with AuditIndex(index_db) as index:
        index.add_files(paths)
        files = [os.path.abspath(p) for p in paths]  # as AuditIndex stores them
        hits = {h.rowid: h for h in index.find(request_hash=request_hash, files=files, limit=10_000)} \
            if request_hash else {}
        ids = {request_id} if request_id else set()
        ids.update(h.request_id for h in hits.values() if h.request_id)
        for rid in sorted(ids):
            for h in [*index.find(request_id=rid, files=files, limit=10_000),
                      *index.find(trigger=rid, files=files, limit=10_000)]:
                hits[h.rowid] = h
        order = {f: i for i, f in enumerate(files)}
        found, warnings = [], []
        for h in sorted(hits.values(), key=lambda h: (order.get(h.file, len(order)), h.line)):
            raw = index.record_line(h)
            found.append(Found(h.file, h.line, raw, parse_line(raw)))
            if not h.verified:
                warnings.append(f"{h.file} line {h.line}: the hash chain does not verify up to this record "
                                "(edited, removed or inserted records before it): run `egressgate audit verify`")
    return found, warnings
