"""One audit line -> the fields the index stores, and its chain hash (recorded and recomputed).

Why not `json.loads` every line: a gateway record is ~2.3 kB of JSON and `json.loads` costs ~14 us of it,
most of it building ~100 small dicts the index never looks at; the index build goal (>= 50k records/s,
loadtests/index_bench.py) leaves ~20 us per record for parsing, hashing and the SQLite insert together.
The audit profile (audit/record.py) is canonical: sorted attribute keys, compact separators, ASCII only.
So a top-level string attribute is the exact bytes `{"key":"<name>","value":{"stringValue":"<v>"}}`, found
by one regular expression. That text contains unescaped quotes, which JSON allows only as structure, so a
hostile value can never imitate one; but a hostile *nested* key can (sandbox labels and `extra` dicts are
`kvlistValue`s whose entries have the same shape: a label named `egressgate.request.hash` would otherwise
plant a fake request hash on a record). The rule, enforced in `fast_values`: every `kvlistValue` is cut out
of the line before the search; its extent is measured by the C JSON decoder (`raw_decode`). Any line the
fast path is not sure about (a backslash left in the line, non-ASCII bytes) is parsed with `json.loads`
instead (`json_values`, also the test oracle: both must agree on hostile records).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from egressgate.audit.chain import HASH_FIELD_PREFIX, PLACEHOLDER
from egressgate.audit.record import K_CHAIN_PREV, K_CHAIN_SEQ, K_HOST, K_OPERATION

K_REQUEST_ID = "egressgate.request.id"
K_REQUEST_HASH = "egressgate.request.hash"
K_SANDBOX = "egressgate.sandbox.id"
K_DECISION = "egressgate.decision"
K_REASON = "egressgate.reason"
K_RULE = "egressgate.rule"
K_TRIGGER = "egressgate.trigger_request"  # audit/find.py: a credential minted for a request names it
K_CP_FINAL = "egressgate.checkpoint.final"

# The values every line yields, in this order (a list, not a dict: this runs for every record).
SLOTS = ("seq", "prev", "time_ns", "kind", "request_id", "request_hash", "sandbox", "host", "decision", "reason",
         "rule", "trigger", "final")
_SLOT = {name: i for i, name in enumerate(SLOTS)}
# (attribute, slot)
_STRING_KEYS: tuple[tuple[str, int], ...] = tuple(sorted((
    (K_CHAIN_PREV, _SLOT["prev"]),
    (K_DECISION, _SLOT["decision"]),
    (K_OPERATION, _SLOT["kind"]),
    (K_REASON, _SLOT["reason"]),
    (K_REQUEST_HASH, _SLOT["request_hash"]),
    (K_REQUEST_ID, _SLOT["request_id"]),
    (K_RULE, _SLOT["rule"]),
    (K_SANDBOX, _SLOT["sandbox"]),
    (K_TRIGGER, _SLOT["trigger"]),
    (K_HOST, _SLOT["host"]),
)))
_SLOT_OF = {k.encode(): i for k, i in _STRING_KEYS}
# A top-level string attribute we index; its value has no quote or backslash (lines with a backslash left
# after the cut go to json).
_ATTRIBUTE = re.compile(b'\\{"key":"(' + b"|".join(re.escape(k) for k in _SLOT_OF)
                        + b')","value":\\{"stringValue":"([^"\\\\]*)"\\}\\}')
_I_SEQ, _I_TIME, _I_KIND, _I_FINAL = _SLOT["seq"], _SLOT["time_ns"], _SLOT["kind"], _SLOT["final"]
_SEQ_PREFIX = f'{{"key":"{K_CHAIN_SEQ}","value":{{"intValue":"'.encode()
_FINAL_TRUE = f'{{"key":"{K_CP_FINAL}","value":{{"boolValue":true}}}}'.encode()
_KVLIST = b'{"kvlistValue":'
_TIME = b'"timeUnixNano":"'
_HASH_LEN = len(HASH_FIELD_PREFIX)
_DECODER = json.JSONDecoder()


class LineError(ValueError):
    """Not a chained egressgate record (the index keeps its position, not its content)."""


@dataclass(slots=True)
class Fields:
    recorded: str  # the chain.hash the line carries
    computed: str  # the chain.hash it should carry (audit/chain.py)
    seq: int | None
    prev: str | None
    time_ns: int
    kind: str
    request_id: str | None
    request_hash: str | None
    sandbox: str | None
    host: str | None
    decision: str | None
    reason: str | None
    rule: str | None
    trigger: str | None
    final: bool  # a final checkpoint (nothing may follow it in its file)


def chain_hashes(line: bytes) -> tuple[str, str]:
    """(recorded, computed) chain.hash of `line`; the rule (exactly one hash field) is chain.py's."""
    pos = line.find(HASH_FIELD_PREFIX)
    if pos < 0 or line.find(HASH_FIELD_PREFIX, pos + 1) >= 0:
        raise LineError("line must contain exactly one egressgate.chain.hash attribute")
    pos += _HASH_LEN
    if line[pos + 64 : pos + 67] != b'"}}':
        raise LineError("egressgate.chain.hash must be 64 lower-case hex characters")
    recorded = line[pos : pos + 64].decode("ascii", "replace")
    computed = hashlib.sha256(line[:pos] + PLACEHOLDER + line[pos + 64 :]).hexdigest()
    return recorded, computed


def fields_of(line: bytes) -> Fields:
    """The index fields of one line (without its newline). Raises LineError."""
    recorded, computed = chain_hashes(line)
    values = values_of(line)
    return Fields(recorded, computed, *values)


def values_of(line: bytes) -> list:
    """The SLOTS values of one line: by byte search, or through json when the fast path is not sure."""
    values = fast_values(line)
    return json_values(line) if values is None else values


def fast_values(line: bytes) -> list | None:
    """The SLOTS values by one regular expression over the line with its kvlistValue spans cut out, or None
    when the line needs the JSON parser (see module docstring)."""
    if not line.isascii():
        return None
    i = line.find(_KVLIST)
    if i >= 0:  # cut every kvlistValue (labels, extra dicts): their entries look like attributes
        text = line.decode("ascii")
        parts = []
        last = 0
        try:
            while i >= 0:
                end = _DECODER.raw_decode(text, i)[1]
                parts.append(line[last:i])
                last = end
                i = line.find(_KVLIST, end)
        except ValueError:
            return None
        parts.append(line[last:])
        line = b"".join(parts)  # what is left cannot form a new attribute: a cut leaves `"value":}`
    if b"\\" in line:
        return None  # an escape in a top-level value: the expression stops at quotes, json decides
    out: list = [None] * 12 + [False]
    for key, value in _ATTRIBUTE.findall(line):
        out[_SLOT_OF[key]] = value.decode("ascii")
    pos = line.find(_SEQ_PREFIX)
    if pos >= 0:
        begin = pos + len(_SEQ_PREFIX)
        digits = line[begin : line.find(b'"', begin)]
        if not digits.isdigit():
            return None
        out[_I_SEQ] = int(digits)
    t = line.rfind(_TIME)
    if t < 0:
        return None
    begin = t + len(_TIME)
    digits = line[begin : line.find(b'"', begin)]
    if not digits.isdigit():
        return None
    out[_I_TIME] = int(digits)
    if out[_I_KIND] is None:
        out[_I_KIND] = ""
    elif out[_I_KIND] == "checkpoint":
        out[_I_FINAL] = _FINAL_TRUE in line
    return out


def json_values(line: bytes) -> list:
    """The same values through `json.loads` (the slow path and the oracle of the fast one)."""
    try:
        doc = json.loads(line)
        logs = doc["resourceLogs"]
        scopes = logs[0]["scopeLogs"]
        recs = scopes[0]["logRecords"]
        if len(logs) != 1 or len(scopes) != 1 or len(recs) != 1:
            raise LineError("expected exactly one log record per line")
        rec = recs[0]
        attrs = {kv["key"]: kv.get("value", {}) for kv in rec.get("attributes", [])}
        time_ns = int(rec["timeUnixNano"])
    except LineError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise LineError(f"not an egressgate OTLP/JSON record: {exc}") from exc
    out: list = [None] * 12 + [False]
    out[_I_TIME] = time_ns
    for key, slot in _STRING_KEYS:
        value = attrs.get(key)
        if isinstance(value, dict) and isinstance(value.get("stringValue"), str):
            out[slot] = value["stringValue"]
    seq = attrs.get(K_CHAIN_SEQ)
    if isinstance(seq, dict) and isinstance(seq.get("intValue"), str) and seq["intValue"].isdigit():
        out[_I_SEQ] = int(seq["intValue"])
    if out[_I_KIND] is None:
        out[_I_KIND] = ""
    elif out[_I_KIND] == "checkpoint":
        out[_I_FINAL] = attrs.get(K_CP_FINAL) == {"boolValue": True}
    return out


def json_fields(line: bytes) -> Fields:
    """fields_of() through json only (the oracle of the fast path in tests)."""
    return Fields(*chain_hashes(line), *json_values(line))
