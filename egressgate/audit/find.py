"""`egressgate audit find`: the records of one request across audit files.

A request's decision record carries `egressgate.request.hash`; its outcome record (status, bytes) is linked
only by `egressgate.request.id`, so records sharing the request id of a hash match are returned too, and so
are the credential-issue records whose `egressgate.trigger_request` names that request.
"""

from __future__ import annotations

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
