"""The per-file hash chain and signed checkpoints (specified in docs/audit.md, "Chain").

Why hash the line bytes with a placeholder instead of a re-serialized structure: an auditor can then
recompute every hash with `sed` and `sha256sum`, in any language, without reproducing our JSON encoder;
any byte change to a line (including re-formatting) is detected.

    chain.hash(record) = hex(SHA-256(line with the chain.hash value replaced by 64 "0" characters))

Every line carries `egressgate.chain.seq` (0, 1, 2, ... per file) and `egressgate.chain.prev` (the
previous line's chain.hash; for seq 0, the last hash of the previous file or 64 "0"). Seq 0 is a
`chain_start` record; a signed `checkpoint` record follows every N records and ends the file (`final`).
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
    Record,
)

GENESIS = "0" * 64
PLACEHOLDER = b"0" * 64
HASH_FIELD_PREFIX = b'{"key":"' + K_CHAIN_HASH.encode() + b'","value":{"stringValue":"'
CHECKPOINT_DOMAIN = b"egressgate-audit-checkpoint-v1\n"

OP_CHAIN_START = "chain_start"
OP_CHECKPOINT = "checkpoint"
K_CP_FINAL = "egressgate.checkpoint.final"
K_CP_HEAD = "egressgate.checkpoint.head"
K_CP_COUNT = "egressgate.checkpoint.count"
K_CP_ALG = "egressgate.checkpoint.alg"
K_CP_SIG = "egressgate.checkpoint.signature"
K_KEY_ID = "egressgate.key_id"


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


def checkpoint_message(seq: int, head: str, final: bool, time_ns: int) -> bytes:
    """The exact bytes a checkpoint signs: it covers records 0..seq-1 (head = chain.hash of seq-1)."""
    return CHECKPOINT_DOMAIN + f"{seq}\n{head}\n{'final' if final else 'periodic'}\n{time_ns}\n".encode()


@dataclass(slots=True)
class ChainState:
    seq: int = 0  # seq of the next line
    prev: str = GENESIS  # chain.hash of the last line written
    since_checkpoint: int = 0  # lines since the last checkpoint


class ChainWriter:
    """Assigns seq/prev/hash to records and encodes them. Not thread-safe: one writer task owns it."""

    def __init__(self, prev: str = GENESIS) -> None:
        self.state = ChainState(prev=prev)

    def snapshot(self) -> ChainState:
        s = self.state
        return ChainState(s.seq, s.prev, s.since_checkpoint)

    def restore(self, snap: ChainState) -> None:
        self.state = ChainState(snap.seq, snap.prev, snap.since_checkpoint)

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
        s.since_checkpoint = (
            0 if record.attributes.get(K_OPERATION) == OP_CHECKPOINT else s.since_checkpoint + 1
        )
        return line

    @staticmethod
    def start_record(time_ns: int, key_id: str, prev_file: str | None) -> Record:
        attrs: dict = {K_OPERATION: OP_CHAIN_START, K_KEY_ID: key_id}
        if prev_file:
            attrs["egressgate.chain.prev_file"] = prev_file
        return Record(time_ns, SEVERITY_INFO, "INFO", "egressgate.chain_start", "audit chain start", attrs)

    def checkpoint_payload(self, time_ns: int, final: bool) -> bytes:
        return checkpoint_message(self.state.seq, self.state.prev, final, time_ns)

    def checkpoint_record(
        self, time_ns: int, key_id: str, algorithm: str, signature: bytes, final: bool
    ) -> Record:
        s = self.state
        attrs: dict = {
            K_OPERATION: OP_CHECKPOINT,
            K_CP_FINAL: final,
            K_CP_HEAD: s.prev,
            K_CP_COUNT: s.seq,
            K_CP_ALG: algorithm,
            K_KEY_ID: key_id,
            K_CP_SIG: base64.b64encode(signature).decode("ascii"),
        }
        body = f"audit checkpoint {'final' if final else 'periodic'} covering seq 0..{s.seq - 1}"
        return Record(time_ns, SEVERITY_INFO, "INFO", "egressgate.checkpoint", body, attrs)
