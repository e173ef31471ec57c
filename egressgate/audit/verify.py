"""`egressgate audit verify`: check the hash chain and the signed checkpoints of audit files.

Why the first problem only: after the first break every later hash is suspect, and an auditor needs one
precise statement ("line 17 (seq 16): record edited") to start an investigation, not a cascade. What is
and is not detectable is listed in docs/audit.md ("What verify detects").

Coverage crosses files: each file's seq 0 carries the previous file's last hash, so a signature covers every
earlier line of the linked history. A file the gateway could not seal (crash) or whose checkpoints were
deferred (signer down) is therefore accepted when a later linked file carries a signature; every such
range is reported as a warning, and records that no signature covers are an error (unless
`--allow-unsealed`, for the live tail).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from egressgate.audit.chain import (
    GENESIS,
    K_CP_COUNT,
    K_CP_DEFERRED,
    K_CP_ERROR,
    K_CP_FINAL,
    K_CP_HEAD,
    K_CP_RECOVERY,
    K_CP_SIG,
    K_INCIDENT,
    K_INCIDENT_DETAIL,
    K_KEY_ID,
    OP_CHAIN_START,
    OP_CHECKPOINT,
    OP_INCIDENT,
    checkpoint_kind,
    checkpoint_message,
    compute_line_hash,
    recorded_line_hash,
)
from egressgate.audit.outcomes import OutcomeTracker
from egressgate.audit.record import K_CHAIN_PREV, K_CHAIN_SEQ, K_OPERATION, RecordFormatError, parse_line
from egressgate.audit.signer import verify_signature


@dataclass(slots=True)
class FileReport:
    path: str
    records: int = 0
    checkpoints: int = 0
    first_prev: str | None = None
    last_hash: str | None = None
    last_seq: int = -1
    last_signed_seq: int = -1  # seq of the last valid checkpoint (covers 0..seq-1)
    sealed: bool = False  # ends with a final checkpoint (signed, or deferred: see unsigned_from)
    first_signed_seq: int = -1  # seq of the first valid signed checkpoint
    unsigned_from: int | None = None  # first seq after the last signature (None: the last line is signed)
    deferred: list[int] = field(default_factory=list)  # deferred checkpoints not yet covered in this file
    error: str | None = None  # first problem, None when the file verifies
    warnings: list[str] = field(default_factory=list)
    # request ids of allowed decisions a crash sealed in this file left without an outcome (outcomes.py)
    missing_outcomes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class _Line:
    number: int
    seq: int
    prev: str
    recorded: str
    computed: str
    op: str
    attrs: dict
    time_ns: int


def _parse(number: int, raw: bytes) -> _Line:
    rec = parse_line(raw)
    seq = rec.attributes.get(K_CHAIN_SEQ)
    prev = rec.attributes.get(K_CHAIN_PREV)
    if not isinstance(seq, int) or not isinstance(prev, str):
        raise RecordFormatError("missing egressgate.chain.seq / egressgate.chain.prev")
    return _Line(
        number,
        seq,
        prev,
        recorded_line_hash(raw),
        compute_line_hash(raw),
        str(rec.attributes.get(K_OPERATION, "")),
        rec.attributes,
        rec.time_ns,
    )


def _check_checkpoint(line: _Line, keys: dict[str, Ed25519PublicKey]) -> str | None:
    a = line.attrs
    where = f"line {line.number} (seq {line.seq})"
    if a.get(K_CP_COUNT) != line.seq or a.get(K_CP_HEAD) != line.prev:
        return f"{where}: checkpoint does not describe its own position (count/head mismatch): edited"
    if _is_deferred(a):
        return None  # unsigned by design: it proves nothing, a later signature must cover it
    key = keys.get(str(a.get(K_KEY_ID)))
    if key is None:
        return f"{where}: checkpoint signed by untrusted or unknown key {a.get(K_KEY_ID)!r}"
    try:
        sig = base64.b64decode(str(a.get(K_CP_SIG, "")), validate=True)
    except (binascii.Error, ValueError):
        return f"{where}: bad signature (not base64)"
    message = checkpoint_message(line.seq, line.prev, checkpoint_kind(a), line.time_ns)
    if not verify_signature(key, message, sig):
        return f"{where}: bad signature on checkpoint (records 0..{line.seq - 1} altered, or forged)"
    return None


def _is_deferred(attrs: dict) -> bool:
    return K_CP_SIG not in attrs and bool(attrs.get(K_CP_DEFERRED))


def _note_checkpoint(report: FileReport, ln: _Line) -> None:
    """Coverage bookkeeping and the warnings an auditor must see (late signatures, crash seals)."""
    a = ln.attrs
    if _is_deferred(a):
        report.deferred.append(ln.seq)
        return
    if report.first_signed_seq < 0:
        report.first_signed_seq = ln.seq
    if report.deferred:
        report.warnings.append(
            f"checkpoint(s) at seq {', '.join(map(str, report.deferred))} were deferred (signer unavailable); "
            f"records up to seq {ln.seq - 1} were signed late by the checkpoint at seq {ln.seq}"
        )
        report.deferred = []
    report.last_signed_seq = ln.seq
    if a.get(K_CP_RECOVERY):
        report.warnings.append(
            f"line {ln.number}: sealed at restart by a recovery checkpoint (the gateway had stopped without "
            f"sealing this file: {a.get('egressgate.recovery.reason', 'crash')}); records after the previous "
            f"checkpoint were signed only then"
        )


def _unsigned_message(report: FileReport) -> str:
    if not report.sealed:
        if report.last_signed_seq < 0:
            unsigned = "no checkpoint at all"
        elif report.last_signed_seq == report.last_seq:
            unsigned = f"the last checkpoint, at seq {report.last_seq}, is not final"
        else:
            unsigned = f"records {report.last_signed_seq + 1}..{report.last_seq} not covered by a signature"
        return f"truncated after seq {report.last_seq}: no final checkpoint ({unsigned})"
    return (
        f"records {report.unsigned_from}..{report.last_seq} are not covered by any signature (checkpoints at "
        f"seq {', '.join(map(str, report.deferred))} deferred: the signer was unavailable)"
    )


def verify_file(
    path: str | Path,
    keys: dict[str, Ed25519PublicKey],
    allow_unsealed: bool = False,
    require_seal: bool = True,
    outcomes: OutcomeTracker | None = None,
) -> FileReport:
    """One file. `require_seal=False` leaves the "is the end covered" question to verify_files, which can
    find the covering signature in a later file. `outcomes` is fed every record (verify_files: decisions
    a crash left without an outcome)."""
    report = FileReport(str(path))
    data = Path(path).read_bytes()
    chunks = data.split(b"\n")
    if chunks and chunks[-1] == b"":
        chunks.pop()
    elif chunks:
        report.error = f"line {len(chunks)}: partial last line (file truncated mid-record)"
        return report
    lines: list[_Line] = []
    for number, raw in enumerate(chunks, start=1):
        try:
            lines.append(_parse(number, raw))
        except (RecordFormatError, ValueError) as exc:
            report.error = f"line {number}: not a valid chained record (edited or corrupted): {exc}"
            return report
    if not lines:
        report.error = "empty file: no chain_start record (truncated to nothing)"
        return report
    later_seqs: dict[int, int] = {}
    for ln in lines:
        later_seqs[ln.seq] = ln.number
    prev_hash: str | None = None
    for expected, ln in enumerate(lines):
        where = f"line {ln.number} (seq {ln.seq})"
        if ln.computed != ln.recorded:
            report.error = f"{where}: record edited (its content does not match its chain hash)"
            return report
        if ln.seq != expected:
            if ln.seq < expected or later_seqs.get(expected, 0) > ln.number:
                report.error = f"{where}: records reordered (expected seq {expected} here)"
            else:
                report.error = (
                    f"{where}: records removed (seq {expected}..{ln.seq - 1} missing before this line)"
                )
            return report
        if ln.seq == 0:
            if ln.op != OP_CHAIN_START:
                report.error = f"{where}: first record is not a chain_start record (records removed)"
                return report
            report.first_prev = ln.prev
        elif ln.prev != prev_hash:
            report.error = (
                f"{where}: chain.prev does not match the previous record's hash "
                f"(record seq {ln.seq - 1} was edited and re-hashed, or replaced)"
            )
            return report
        if report.sealed:
            report.error = f"{where}: record after the final checkpoint (appended after the file was sealed)"
            return report
        if ln.op == OP_CHECKPOINT:
            problem = _check_checkpoint(ln, keys)
            if problem:
                report.error = problem
                return report
            report.checkpoints += 1
            _note_checkpoint(report, ln)
            report.sealed = bool(ln.attrs.get(K_CP_FINAL))
            if outcomes is not None and ln.attrs.get(K_CP_RECOVERY):
                outcomes.crash(str(path), ln.number)
        elif ln.op == OP_INCIDENT:
            report.warnings.append(
                f"line {ln.number}: audit incident {ln.attrs.get(K_INCIDENT)}: {ln.attrs.get(K_INCIDENT_DETAIL)}"
            )
            if outcomes is not None and ln.attrs.get(K_INCIDENT) == "crash_tail_invalid":
                outcomes.crash(str(path), ln.number)  # the crashed file was not sealed: the crash is known here
        elif outcomes is not None:
            outcomes.feed(ln.attrs)
        prev_hash = ln.recorded
    report.records = len(lines)
    report.last_seq = lines[-1].seq
    report.last_hash = lines[-1].recorded
    if not (lines[-1].op == OP_CHECKPOINT and not _is_deferred(lines[-1].attrs)):
        report.unsigned_from = report.last_signed_seq + 1
    if lines[-1].op == OP_CHECKPOINT and _is_deferred(lines[-1].attrs) and lines[-1].attrs.get(K_CP_ERROR):
        report.warnings.append(f"signer error at the last checkpoint: {lines[-1].attrs.get(K_CP_ERROR)}")
    if require_seal and (not report.sealed or report.unsigned_from is not None):
        msg = _unsigned_message(report)
        if allow_unsealed:
            report.warnings.append(msg + " - accepted: file is still open (--allow-unsealed)")
        else:
            report.error = msg
    return report


def verify_files(
    paths: Sequence[str | Path], keys: dict[str, Ed25519PublicKey], allow_unsealed: bool = False
) -> list[FileReport]:
    """Verify each file, then the links between consecutive files (in the order given); stop at the
    first failure. A file that is not sealed, or ends unsigned, is accepted when the next file links to it
    and a later signature covers it; what no signature covers is an error, or with `allow_unsealed` (the
    live tail) a warning."""
    reports: list[FileReport] = []
    uncovered: list[str] = []  # ranges waiting for a later signature
    outcomes = OutcomeTracker()
    for i, path in enumerate(paths):
        rep = verify_file(path, keys, require_seal=False, outcomes=outcomes)
        reports.append(rep)
        if not rep.ok:
            return reports
        if i > 0 and rep.first_prev != GENESIS and rep.first_prev != reports[i - 1].last_hash:
            rep.error = (
                f"{path} does not continue {reports[i - 1].path}: a file is missing between them, "
                "the files are out of order, or the previous file was altered"
            )
            return reports
        if i > 0 and rep.first_prev == GENESIS:
            if uncovered:
                rep.error = f"{path} starts a new chain, so nothing covers {'; '.join(uncovered)}"
                return reports
            rep.warnings.append(f"{path} starts a new chain (not linked to {reports[i - 1].path})")
        if i == 0 and rep.first_prev not in (None, GENESIS):
            rep.warnings.append(
                f"{path} continues an earlier file not given here (prev {rep.first_prev[:16]}...)"
            )
        if uncovered and rep.first_signed_seq >= 0:
            rep.warnings.append(
                f"{'; '.join(uncovered)} signed late, by the checkpoint at seq {rep.first_signed_seq} of this "
                "file (the chain links the files)"
            )
            uncovered = []
        if i < len(paths) - 1 and not rep.sealed:
            rep.warnings.append(
                f"no final checkpoint after seq {rep.last_seq} (the gateway stopped without sealing it); "
                "the next file's link and a later signature cover it"
            )
        if rep.unsigned_from is not None:
            uncovered.append(f"records {rep.unsigned_from}..{rep.last_seq} of {path}")
    by_path = {r.path: r for r in reports}
    for gap in outcomes.gaps():  # after every file: an outcome the next run wrote (retry spool) closes its decision
        by_path[gap.path].missing_outcomes.extend(gap.request_ids)
        by_path[gap.path].warnings.append(gap.message())
    last = reports[-1]
    if uncovered or not last.sealed:
        msg = _unsigned_message(last) if not last.sealed else (
            f"{'; '.join(uncovered)} not covered by any signature (the signer was unavailable)")
        if allow_unsealed:
            last.warnings.append(msg + " - accepted: file is still open (--allow-unsealed)")
        else:
            last.error = msg
    return reports
