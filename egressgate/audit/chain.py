"""The per-file hash chain and signed checkpoints (specified in docs/audit.md, "Chain").

Why hash the line bytes with a placeholder instead of a re-serialized structure: an auditor can then
recompute every hash with `sed` and `sha256sum`, in any language, without reproducing our JSON encoder;
any byte change to a line (including re-formatting) is detected.

    chain.hash(record) = hex(SHA-256(line with the chain.hash value replaced by 64 "0" characters))

Every line carries `egressgate.chain.seq` (0, 1, 2, ... per file) and `egressgate.chain.prev` (the
previous line's chain.hash; for seq 0, the last hash of the previous file or 64 "0"). Seq 0 is a
`chain_start` record; a signed `checkpoint` record follows every N records and ends the file (`final`).

Because every file's seq 0 links to the previous file's last hash, a signature covers everything before
it, across files. That is what lets a checkpoint be *deferred* (written unsigned while the signer is down,
covered by the next signed one) and a crashed file be sealed at restart by a `recovery` checkpoint.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from egressgate.audit.encode import encode_record
from egressgate.audit.record import (
    K_CHAIN_HASH,
    K_CHAIN_PREV,
    K_CHAIN_SEQ,
    K_OPERATION,
    SEVERITY_INFO,
    SEVERITY_WARN,
    Record,
)

GENESIS = "0" * 64
PLACEHOLDER = b"0" * 64
HASH_FIELD_PREFIX = b'{"key":"' + K_CHAIN_HASH.encode() + b'","value":{"stringValue":"'
CHECKPOINT_DOMAIN = b"egressgate-audit-checkpoint-v1\n"

OP_CHAIN_START = "chain_start"
OP_CHECKPOINT = "checkpoint"
OP_INCIDENT = "audit_incident"  # something happened to the trail itself (file deleted/moved, crash)
K_CP_FINAL = "egressgate.checkpoint.final"
K_CP_HEAD = "egressgate.checkpoint.head"
K_CP_COUNT = "egressgate.checkpoint.count"
K_CP_ALG = "egressgate.checkpoint.alg"
K_CP_SIG = "egressgate.checkpoint.signature"
K_KEY_ID = "egressgate.key_id"
K_CP_RECOVERY = "egressgate.checkpoint.recovery"  # final checkpoint written at restart after a crash
K_CP_DEFERRED = "egressgate.checkpoint.deferred"  # unsigned: the signer was unavailable
K_CP_ERROR = "egressgate.checkpoint.error"
K_INCIDENT = "egressgate.incident"
K_INCIDENT_DETAIL = "egressgate.incident.detail"

# what a checkpoint's signature states about its position (part of the signed message)
KIND_PERIODIC = "periodic"
KIND_FINAL = "final"
KIND_RECOVERY = "recovery"  # final, written at restart into a file a crash left unsealed


class ChainFormatError(ValueError):
    """A line without exactly one well-formed chain.hash field."""


def hash_field_span(line: bytes) -> int:
    """Offset of the 64 hex chain.hash characters in `line`. The prefix contains unescaped quotes, which
    JSON allows only as structure (inside strings a quote is always `\\"`), so it cannot be forged by a
    hostile attribute value."""
    start = line.find(HASH_FIELD_PREFIX)
    if start < 0 or line.find(HASH_FIELD_PREFIX, start + 1) >= 0:
        raise ChainFormatError("line must contain exactly one egressgate.chain.hash attribute")
    pos = start + len(HASH_FIELD_PREFIX)
    if line[pos + 64 : pos + 67] != b'"}}':
        raise ChainFormatError("egressgate.chain.hash must be 64 lower-case hex characters")
    return pos


def compute_line_hash(line: bytes) -> str:
    """chain.hash of a line as it should be (whatever value the line currently carries)."""
    pos = hash_field_span(line)
    return hashlib.sha256(line[:pos] + PLACEHOLDER + line[pos + 64 :]).hexdigest()


def recorded_line_hash(line: bytes) -> str:
    pos = hash_field_span(line)
    return line[pos : pos + 64].decode("ascii", "replace")


def checkpoint_message(seq: int, head: str, kind: str, time_ns: int) -> bytes:
    """The exact bytes a checkpoint signs: it covers records 0..seq-1 (head = chain.hash of seq-1).
    `kind` is `periodic`, `final` or `recovery`: a crash seal cannot pass for a clean close."""
    return CHECKPOINT_DOMAIN + f"{seq}\n{head}\n{kind}\n{time_ns}\n".encode()


def checkpoint_kind(attrs: dict) -> str:
    """The signed kind of a checkpoint record, from its attributes."""
    if attrs.get(K_CP_RECOVERY):
        return KIND_RECOVERY
    return KIND_FINAL if attrs.get(K_CP_FINAL) else KIND_PERIODIC


@dataclass(slots=True)
class ChainState:
    seq: int = 0  # seq of the next line
    prev: str = GENESIS  # chain.hash of the last line written
    since_checkpoint: int = 0  # lines since the last checkpoint (signed or deferred)
    since_signed: int = 0  # lines since the last *signed* checkpoint, carried across files


class ChainWriter:
    """Assigns seq/prev/hash to records and encodes them. Not thread-safe: one writer task owns it."""

    def __init__(self, prev: str = GENESIS, seq: int = 0, since_signed: int = 0) -> None:
        self.state = ChainState(seq=seq, prev=prev, since_signed=since_signed)

    def snapshot(self) -> ChainState:
        s = self.state
        return ChainState(s.seq, s.prev, s.since_checkpoint, s.since_signed)

    def restore(self, snap: ChainState) -> None:
        self.state = ChainState(snap.seq, snap.prev, snap.since_checkpoint, snap.since_signed)

    def append(self, record: Record) -> bytes:
        """Encode `record` as the next line of the chain (no newline) and advance the chain."""
        s = self.state
        record.attributes[K_CHAIN_SEQ] = s.seq
        record.attributes[K_CHAIN_PREV] = s.prev
        record.attributes[K_CHAIN_HASH] = PLACEHOLDER.decode()
        line = encode_record(record)
        pos = hash_field_span(line)
        digest = hashlib.sha256(line).hexdigest()
        line = line[:pos] + digest.encode() + line[pos + 64 :]
        record.attributes[K_CHAIN_HASH] = digest
        s.seq += 1
        s.prev = digest
        is_cp = record.attributes.get(K_OPERATION) == OP_CHECKPOINT
        s.since_checkpoint = 0 if is_cp else s.since_checkpoint + 1
        s.since_signed = 0 if is_cp and K_CP_SIG in record.attributes else s.since_signed + 1
        return line

    @staticmethod
    def start_record(time_ns: int, key_id: str, prev_file: str | None) -> Record:
        attrs: dict = {K_OPERATION: OP_CHAIN_START, K_KEY_ID: key_id}
        if prev_file:
            attrs["egressgate.chain.prev_file"] = prev_file
        return Record(time_ns, SEVERITY_INFO, "INFO", "egressgate.chain_start", "audit chain start", attrs)

    def checkpoint_payload(self, time_ns: int, kind: str) -> bytes:
        return checkpoint_message(self.state.seq, self.state.prev, kind, time_ns)

    def checkpoint_record(
        self,
        time_ns: int,
        key_id: str,
        algorithm: str,
        signature: bytes | None,
        kind: str,
        *,
        error: str | None = None,
        extra: dict | None = None,
    ) -> Record:
        """A checkpoint at the current position. `signature=None` writes a *deferred* checkpoint (the
        signer is down): it marks the position but proves nothing; the next signed checkpoint covers it."""
        s = self.state
        attrs: dict = {
            K_OPERATION: OP_CHECKPOINT,
            K_CP_FINAL: kind != KIND_PERIODIC,
            K_CP_HEAD: s.prev,
            K_CP_COUNT: s.seq,
            K_CP_ALG: algorithm,
            K_KEY_ID: key_id,
            **(extra or {}),
        }
        if kind == KIND_RECOVERY:
            attrs[K_CP_RECOVERY] = True
        if signature is not None:
            attrs[K_CP_SIG] = base64.b64encode(signature).decode("ascii")
            body = f"audit checkpoint {kind} covering seq 0..{s.seq - 1}"
            return Record(time_ns, SEVERITY_INFO, "INFO", "egressgate.checkpoint", body, attrs)
        attrs[K_CP_DEFERRED] = True
        if error:
            attrs[K_CP_ERROR] = error[:300]
        body = f"audit checkpoint {kind} DEFERRED (signer unavailable): seq 0..{s.seq - 1} not signed yet"
        return Record(time_ns, SEVERITY_WARN, "WARN", "egressgate.checkpoint", body, attrs)


def incident_record(time_ns: int, incident: str, detail: str, extra: dict | None = None) -> Record:
    """A record about the trail itself (file deleted or moved from outside, crash recovered), chained and
    signed like any other so the incident cannot be removed silently."""
    attrs: dict = {K_OPERATION: OP_INCIDENT, K_INCIDENT: incident, K_INCIDENT_DETAIL: detail, **(extra or {})}
    return Record(time_ns, SEVERITY_WARN, "WARN", "egressgate.audit_incident", f"audit incident {incident}: {detail}",
                  attrs)
