"""AuditEvent -> OTLP/JSON log record, and back.

Why we encode the local file ourselves instead of letting the SDK serialize it: the hash chain is computed
over the exact bytes of each line, so the encoding must be deterministic and reproducible by an auditor
without egressgate. We therefore emit one ExportLogsServiceRequest per line with a fixed JSON profile:
sorted object keys, compact separators, `ensure_ascii` (every non-ASCII and control character becomes a
`\\uXXXX` escape, so CR/LF/ANSI in hostile hosts or paths can never break or forge a line), attributes
sorted by key, 64-bit integers as JSON strings (the proto3 JSON mapping). The same `Record` (time,
severity, attributes) feeds the OpenTelemetry SDK's OTLP/HTTP exporter (audit/exporter.py), so the
collector sees the same attributes, chain fields included.

Sandbox labels are one `kvlistValue` attribute (`egressgate.sandbox.labels`) rather than flattened keys:
label keys are arbitrary strings, and a kvlist round-trips them exactly for `audit replay`.
"""

from __future__ import annotations

import ipaddress
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from egressgate.audit.event import AuditEvent, EventKind

SCOPE_NAME = "egressgate.audit"
SCOPE_VERSION = "1"
SERVICE_NAME = "egressgate"

SEVERITY_INFO = 9
SEVERITY_WARN = 13

# attribute keys (OpenTelemetry semantic conventions where they exist)
K_METHOD = "http.request.method"
K_HOST = "server.address"
K_PORT = "server.port"
K_PATH = "url.path"
K_QUERY = "url.query"
K_SCHEME = "url.scheme"
K_PEER = "network.peer.address"
K_CLIENT = "client.address"
K_STATUS = "http.response.status_code"
K_DNS_NAME = "dns.question.name"
K_CHAIN_SEQ = "egressgate.chain.seq"
K_CHAIN_PREV = "egressgate.chain.prev"
K_CHAIN_HASH = "egressgate.chain.hash"
K_OPERATION = "egressgate.operation"
K_OP_CLASS = "egressgate.operation.class"  # package_install | publish (policy/opclass.py)
K_OP_PROTOCOL = "egressgate.operation.protocol"  # pypi, npm, git, oci...
K_LABELS = "egressgate.sandbox.labels"

Value = str | int | float | bool | list[Any] | dict[str, Any]


@dataclass(slots=True)
class Record:
    """One log record before encoding. `attributes` values: str, int, float, bool, list, dict."""

    time_ns: int
    severity_number: int
    severity_text: str
    event_name: str
    body: str
    attributes: dict[str, Value] = field(default_factory=dict)


def clean_str(value: str | bytes) -> str:
    """Make any string safe to encode: invalid UTF-8 bytes and lone surrogates become visible
    backslash escapes (`\\xff`, `\\udcff`) instead of raising or producing invalid JSON."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if value.isascii():  # the common case: nothing to check
        return value
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("ascii")


def _nested_key(key: Any) -> str:
    """Keys inside kvlists (labels...) may not imitate the chain fields: the chain locates
    `egressgate.chain.hash` by its exact bytes and requires exactly one per line."""
    key = key if type(key) is str and key.isascii() else clean_str(str(key))
    return "_" + key if key.startswith("egressgate.chain.") else key


def _clean_value(value: Any) -> Value:
    # Exact-type checks first: this runs for every attribute of every record, and isinstance against the
    # collections ABCs (Mapping, Sequence) costs several times more than the whole common case.
    t = type(value)
    if t is str:
        return value if value.isascii() else clean_str(value)
    if t is int or t is bool:
        return value
    if t is list:
        return [_clean_value(v) for v in value]
    if t is float:
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # JSON has no NaN/Infinity
    if isinstance(value, str | bytes):
        return clean_str(value)
    if isinstance(value, Mapping):
        return {_nested_key(k): _clean_value(v) for k, v in value.items()}
    if isinstance(value, Sequence | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return [_clean_value(v) for v in items]
    return clean_str(str(value))


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def canonical_target(event: AuditEvent) -> str | None:
    """One string naming the canonical target: `scheme://host:port/path`, `host:port` or `name QTYPE`."""
    if not event.host:
        return None
    if event.kind is EventKind.DNS_QUERY:
        return f"{event.host} {event.qtype or '?'}"
    if event.scheme and event.scheme != "tcp" and event.path is not None:
        return f"{event.scheme}://{_fmt_host(event.host)}:{event.port}{event.path}"
    return f"{_fmt_host(event.host)}:{event.port}" if event.port is not None else event.host


# Keys event_attributes() always considers, even when their value is None: `extra` never overrides them.
_BASE_KEYS = frozenset(
    {
        K_OPERATION,
        "egressgate.request.id",
        "egressgate.sandbox.id",
        "egressgate.decision",
        "egressgate.reason",
        "egressgate.rule",
        "egressgate.policy.name",
        "egressgate.policy.hash",
        "egressgate.target.as_sent",
        "egressgate.target.canonical",
        "egressgate.dns.qtype",
        "egressgate.dns.answers",
        "egressgate.pinned.address",
        "egressgate.bytes.out",
        "egressgate.bytes.in",
        "egressgate.duration_ms",
        "egressgate.capability",
        "egressgate.key_id",
        "egressgate.request.hash",
        "egressgate.body.hash",
        "egressgate.message",
    }
)


_NOT_GIVEN: Any = object()


def event_attributes(event: AuditEvent, target: str | None = _NOT_GIVEN) -> dict[str, Value]:
    """The attribute set for one event (chain fields are added by chain.py). None values are left out;
    `extra` adds `egressgate.*` attributes but never overrides a field of the event, its facts or state.
    (The straightforward version of this function is kept as a test oracle in
    tests/audit/reference_encoding.py; this one skips None early and cleans by exact type.) `target`: the
    event's `canonical_target`, when the caller has it already (record_from_event)."""
    kind = event.kind
    raw: tuple[tuple[str, Any], ...] = (
        ("egressgate.request.id", event.request_id),
        ("egressgate.sandbox.id", event.sandbox_id),
        ("egressgate.decision", event.decision),
        ("egressgate.reason", event.reason),
        ("egressgate.rule", event.rule_id),
        ("egressgate.policy.name", event.policy_name),
        ("egressgate.policy.hash", event.policy_hash),
        ("egressgate.target.as_sent", event.target_as_sent),
        ("egressgate.target.canonical", canonical_target(event) if target is _NOT_GIVEN else target),
        (K_SCHEME, event.scheme),
        (K_HOST, event.host),
        (K_PORT, event.port),
        (K_METHOD, event.method),
        (K_PATH, event.path),
        (K_QUERY, event.query),
        ("egressgate.dns.qtype", event.qtype),
        ("egressgate.dns.answers", event.answers),
        ("egressgate.pinned.address", event.pinned_address),
        (K_PEER, event.pinned_address),
        (K_CLIENT, event.client_address),
        (K_STATUS, event.status),
        ("egressgate.bytes.out", event.bytes_out),
        ("egressgate.bytes.in", event.bytes_in),
        ("egressgate.duration_ms", event.duration_ms),
        ("egressgate.capability", event.capability),
        ("egressgate.key_id", event.key_id),
        ("egressgate.request.hash", event.request_hash),
        ("egressgate.body.hash", event.body_hash),
        ("egressgate.message", event.message),
    )
    # Values are cleaned as they are inserted (one pass); keys are constants except extra's.
    pairs: dict[str, Any] = {K_OPERATION: str(kind)}
    for key, val in raw:
        if val is not None:
            t = type(val)
            if t is str:
                pairs[key] = val if val.isascii() else clean_str(val)
            elif t is int:
                pairs[key] = val
            else:
                pairs[key] = _clean_value(val)
    if kind is EventKind.DNS_QUERY and event.host:
        pairs[K_DNS_NAME] = pairs[K_HOST]
    if event.sandbox_labels:
        pairs[K_LABELS] = _clean_value(dict(event.sandbox_labels))
    facts = event.facts
    if facts is not None:
        pairs["egressgate.facts.addresses"] = _clean_value([str(a) for a in facts.addresses])
        pairs["egressgate.facts.request_bytes"] = _clean_value(facts.request_bytes)
        if facts.op_class is not None:  # what the request does (policy/opclass.py): read back by replay
            pairs[K_OP_CLASS] = _clean_value(facts.op_class)
            pairs[K_OP_PROTOCOL] = _clean_value(facts.op_protocol)
        for key, val in (
            (K_HOST, facts.host),
            (K_PORT, facts.port),
            (K_SCHEME, facts.scheme),
            (K_METHOD, facts.method),
            (K_PATH, facts.path),
            ("egressgate.dns.qtype", facts.qtype),
        ):
            if val is not None and pairs.get(key) is None:
                pairs[key] = _clean_value(val)
    if event.state is not None:
        for key, val in state_attributes(event.state).items():
            pairs[key] = _clean_value(val)
    unclean = False  # a None placeholder or a key that needs cleaning: one more pass (rare)
    for key, val in event.extra.items():
        name = key if key.startswith("egressgate.") else f"egressgate.{key}"
        if name not in _BASE_KEYS and name not in pairs:
            # the first spelling wins (None included), as with setdefault
            if val is None or not name.isascii():
                unclean = True
                pairs[name] = val if val is None else _clean_value(val)
            else:
                t = type(val)
                if t is str:
                    pairs[name] = val if val.isascii() else clean_str(val)
                elif t is int:
                    pairs[name] = val
                else:
                    pairs[name] = _clean_value(val)
    if not unclean:
        return pairs
    return {clean_str(k): v for k, v in pairs.items() if v is not None}


def state_attributes(state: Any) -> dict[str, Any]:
    """SandboxState as recorded for replay: exactly what decide() was given about the past (live
    operator approvals only when there were some: `audit replay` re-decides with them)."""
    approvals = {"egressgate.state.approvals": [
        {k: v for k, v in g.to_json().items() if v is not None} for g in state.approvals]} if state.approvals else {}
    return {**approvals,
        "egressgate.state.admitted_at": float(state.admitted_at),
        "egressgate.state.bytes_out": state.bytes_out,
        "egressgate.state.bytes_in": state.bytes_in,
        "egressgate.state.dns_queries": state.dns_queries,
        "egressgate.state.dns_name_bytes": state.dns_name_bytes,
        "egressgate.state.seen_hosts": sorted(state.seen_hosts),
        "egressgate.state.rule_usage": {
            rule: {"requests": u.requests, "bytes": u.bytes} for rule, u in sorted(state.rule_usage.items())
        },
        # the host patterns seen_hosts answers for exactly (SandboxState.seen_scope), when reduced to some
        **({"egressgate.state.seen_scope": list(state.seen_scope)} if state.seen_scope else {}),
    }


def record_from_event(event: AuditEvent) -> Record:
    deny = event.decision == "deny"
    canonical = canonical_target(event)
    parts = [event.decision or "", str(event.kind), canonical or ""]
    if event.reason:
        parts.append(f"({event.reason})")
    return Record(
        time_ns=int(event.time_ns),
        severity_number=SEVERITY_WARN if deny else SEVERITY_INFO,
        severity_text="WARN" if deny else "INFO",
        event_name=f"egressgate.{event.kind}",
        body=clean_str(" ".join(p for p in parts if p)),
        attributes=event_attributes(event, canonical),
    )


# --- OTLP JSON -----------------------------------------------------------------------------------


def any_value(value: Value) -> dict[str, Any]:
    """Python value -> OTLP/JSON AnyValue (int64 as string, per the proto3 JSON mapping)."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, dict):
        return {"kvlistValue": {"values": key_values(value)}}
    if isinstance(value, list):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    raise TypeError(f"unsupported attribute value type {type(value).__name__}")


def key_values(attrs: Mapping[str, Value]) -> list[dict[str, Any]]:
    return [{"key": k, "value": any_value(attrs[k])} for k in sorted(attrs)]


def from_any_value(value: Mapping[str, Any]) -> Value:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "kvlistValue" in value:
        return {kv["key"]: from_any_value(kv.get("value", {})) for kv in value["kvlistValue"].get("values", [])}
    if "arrayValue" in value:
        return [from_any_value(v) for v in value["arrayValue"].get("values", [])]
    return ""


RESOURCE = {"attributes": key_values({"service.name": SERVICE_NAME})}
SCOPE = {"name": SCOPE_NAME, "version": SCOPE_VERSION}


def to_otlp(record: Record) -> dict[str, Any]:
    """The ExportLogsServiceRequest (as a JSON-ready dict) holding exactly this one record."""
    log_record = {
        "timeUnixNano": str(record.time_ns),
        "observedTimeUnixNano": str(record.time_ns),
        "severityNumber": record.severity_number,
        "severityText": record.severity_text,
        "eventName": record.event_name,
        "body": {"stringValue": record.body},
        "attributes": key_values(record.attributes),
    }
    return {"resourceLogs": [{"resource": RESOURCE, "scopeLogs": [{"scope": SCOPE, "logRecords": [log_record]}]}]}


def dumps(obj: Any) -> bytes:
    """The one JSON profile of the audit file (see module docstring); ASCII-only output."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


class RecordFormatError(ValueError):
    """A line that is not one of our OTLP/JSON records."""


def parse_line(line: bytes | str) -> Record:
    """Line -> Record (attributes decoded back to Python values). Raises RecordFormatError."""
    try:
        doc = json.loads(line)
        lr = doc["resourceLogs"][0]["scopeLogs"][0]["logRecords"]
        if len(doc["resourceLogs"]) != 1 or len(doc["resourceLogs"][0]["scopeLogs"]) != 1 or len(lr) != 1:
            raise RecordFormatError("expected exactly one log record per line")
        rec = lr[0]
        attrs = {kv["key"]: from_any_value(kv.get("value", {})) for kv in rec.get("attributes", [])}
        return Record(
            time_ns=int(rec["timeUnixNano"]),
            severity_number=int(rec.get("severityNumber", 0)),
            severity_text=str(rec.get("severityText", "")),
            event_name=str(rec.get("eventName", "")),
            body=str(rec.get("body", {}).get("stringValue", "")),
            attributes=attrs,
        )
    except RecordFormatError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise RecordFormatError(f"not an egressgate OTLP/JSON record: {exc}") from exc


def addresses_of(attrs: Mapping[str, Value]) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
    """Recorded dial addresses (facts.addresses, else the pinned address: an allowed request's record names
    the address it dialed, a refused one every address the check read), for replay."""
    raw = attrs.get("egressgate.facts.addresses")
    if not isinstance(raw, list) or not raw:
        pinned = attrs.get("egressgate.pinned.address")
        raw = [pinned] if isinstance(pinned, str) else []
    out = []
    for item in raw:
        try:
            out.append(ipaddress.ip_address(str(item)))
        except ValueError:
            continue
    return tuple(out)
