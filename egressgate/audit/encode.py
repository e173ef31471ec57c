"""The fast OTLP/JSON line encoder: the same bytes as `record.dumps(record.to_otlp(r))`, built directly.

Kept apart from record.py (what a record contains and how it is parsed back) because this module is only
about speed: every gateway request and DNS query writes at least one record, and building ~100 small
dicts for json.dumps to walk dominated the audit cost. tests/audit/test_record.py checks that both
encoders give identical bytes over ordinary and hostile records.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from json.encoder import encode_basestring_ascii
from typing import Any

from egressgate.audit.record import K_CHAIN_PREV, RESOURCE, SCOPE, Record, dumps, to_otlp

# --- fast encoder: the same bytes as dumps(to_otlp(record)), without building the nested dicts ----------
#
# json.dumps(sort_keys=True) of to_otlp() spends most of its time walking ~100 small dicts. The structure is
# fixed, so the line is assembled from constant text and one JSON string escape per value
# (`encode_basestring_ascii` is the C function json.dumps itself uses with ensure_ascii=True). Values of any
# unusual type (subclasses, non-str keys...) fall back to dumps(to_otlp()), so the output is always exactly
# that profile; tests compare both over ordinary and hostile records.

_esc = encode_basestring_ascii


class _Unusual(Exception):
    """A value the fast encoder does not handle; the caller falls back to json.dumps."""


def _value_json(value: Any) -> str:
    t = type(value)
    if t is str:
        return '{"stringValue":' + _esc(value) + "}"
    if t is int:
        return '{"intValue":"' + int.__repr__(value) + '"}'
    if t is bool:
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if t is float:
        if not math.isfinite(value):
            raise _Unusual
        return '{"doubleValue":' + float.__repr__(value) + "}"
    if t is list:
        return '{"arrayValue":{"values":[' + ",".join([_value_json(v) for v in value]) + "]}}"
    if t is dict:
        return '{"kvlistValue":{"values":[' + _attributes_json(value) + "]}}"
    raise _Unusual


# Encoded `{"key":..,"value":{"stringValue":..}}` fragments of short string attributes, and the sorted key
# order of recently seen key sets: most attributes of a record (sandbox, policy, decision, reason, name,
# client...) repeat from record to record. Both are bounded and cleared whole when full (hostile, ever-new
# values only cost a miss each); entries are pure functions of their keys, so a stale entry cannot exist.
_FRAGMENTS: dict[tuple[str, str], str] = {}
_FRAGMENTS_MAX = 8192
_FRAGMENT_VALUE_MAX = 256
_ORDERS: dict[tuple[str, ...], list[str]] = {}
_PREFIXES: dict[str, str] = {}  # key -> '{"key":"<key>","value":'
_ORDERS_MAX = 256
# Attributes unique to each record: memoising them would only churn the memo (chain.hash is not: it is
# encoded as the constant placeholder and the digest is spliced into the bytes afterwards).
_NOT_MEMOISED = frozenset({K_CHAIN_PREV, "egressgate.request.id", "egressgate.request.hash", "egressgate.body.hash"})


def _attributes_json(attrs: Mapping[str, Any]) -> str:
    names = tuple(attrs)
    order = _ORDERS.get(names)
    if order is None:
        if any(type(k) is not str for k in names):
            raise _Unusual
        order = sorted(names)
        if len(_ORDERS) >= _ORDERS_MAX:
            _ORDERS.clear()
        _ORDERS[names] = order
    parts = []
    append = parts.append
    frags = _FRAGMENTS
    for key in order:
        value = attrs[key]
        if type(value) is str and len(value) <= _FRAGMENT_VALUE_MAX and key not in _NOT_MEMOISED:
            memo = (key, value)
            frag = frags.get(memo)
            if frag is None:
                frag = '{"key":' + _esc(key) + ',"value":{"stringValue":' + _esc(value) + "}}"
                if len(frags) >= _FRAGMENTS_MAX:
                    frags.clear()
                frags[memo] = frag
            append(frag)
        else:
            prefix = _PREFIXES.get(key)
            if prefix is None:
                prefix = '{"key":' + _esc(key) + ',"value":'
                if len(_PREFIXES) >= _FRAGMENTS_MAX:
                    _PREFIXES.clear()
                _PREFIXES[key] = prefix
            t = type(value)  # the two common cases of _value_json, without its call (~13 per record)
            if t is str:
                append(prefix + '{"stringValue":' + _esc(value) + "}}")
            elif t is int:
                append(prefix + '{"intValue":"' + int.__repr__(value) + '"}}')
            else:
                append(prefix + _value_json(value) + "}")
    return ",".join(parts)


_LINE_HEAD = (
    '{"resourceLogs":[{"resource":'
    + dumps(RESOURCE).decode()
    + ',"scopeLogs":[{"logRecords":[{"attributes":['
)
_LINE_TAIL = '],"scope":' + dumps(SCOPE).decode() + "}]}]}"


def encode_record(record: Record) -> bytes:
    """One line (without the trailing newline): exactly `dumps(to_otlp(record))`, assembled directly."""
    t = record.time_ns
    sev = record.severity_number
    if type(t) is not int or type(sev) is not int:
        return dumps(to_otlp(record))
    try:
        attrs = _attributes_json(record.attributes)
    except _Unusual:
        return dumps(to_otlp(record))
    ts = int.__repr__(t)
    tail = (  # the small pieces first, so the long attribute text is copied once, by the join
        '],"body":{"stringValue":'
        + _esc(record.body)
        + '},"eventName":'
        + _esc(record.event_name)
        + ',"observedTimeUnixNano":"'
        + ts
        + '","severityNumber":'
        + int.__repr__(sev)
        + ',"severityText":'
        + _esc(record.severity_text)
        + ',"timeUnixNano":"'
        + ts
        + '"}'
        + _LINE_TAIL
    )
    return "".join((_LINE_HEAD, attrs, tail)).encode("ascii")


