"""What an attacker without the signing key can do to an audit file: edit a record and recompute every
later chain hash so each line and each link is consistent again. Only a signature can catch that, which
is what the positive controls of the fault tests rely on."""

from __future__ import annotations

import json
from pathlib import Path

from egressgate.audit.chain import compute_line_hash, hash_field_span, recorded_line_hash


def _attrs(doc: dict) -> list[dict]:
    return doc["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]["attributes"]


def _dump(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _rehash(line: bytes) -> bytes:
    pos = hash_field_span(line)
    return line[:pos] + compute_line_hash(line).encode() + line[pos + 64 :]


def rewrite_chain(path: Path, index: int, key: str, value: str) -> None:
    """Set string attribute `key` of line `index` to `value`, then re-link and re-hash every later line."""
    lines = path.read_bytes().splitlines()
    doc = json.loads(lines[index])
    for kv in _attrs(doc):
        if kv["key"] == key:
            kv["value"] = {"stringValue": value}
    lines[index] = _rehash(_dump(doc))
    prev = recorded_line_hash(lines[index])
    for i in range(index + 1, len(lines)):
        doc = json.loads(lines[i])
        for kv in _attrs(doc):
            if kv["key"] == "egressgate.chain.prev":
                kv["value"] = {"stringValue": prev}
            if kv["key"] == "egressgate.checkpoint.head":
                kv["value"] = {"stringValue": prev}
        lines[i] = _rehash(_dump(doc))
        prev = recorded_line_hash(lines[i])
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def line_index(path: Path, predicate) -> int:
    """Index of the first line whose attributes (a dict) satisfy `predicate`."""
    for i, raw in enumerate(path.read_bytes().splitlines()):
        attrs = {kv["key"]: next(iter(kv["value"].values()), None) for kv in _attrs(json.loads(raw))}
        if predicate(attrs):
            return i
    raise AssertionError("no such line")
