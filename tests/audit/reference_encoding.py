"""The original, straightforward record encoder, kept as a test oracle.

egressgate/audit/record.py encodes with a hand-rolled fast path (per-type fragments, one join); the file
format is a contract (the chain hashes the exact bytes), so tests check that the fast path produces exactly
the bytes of this obviously-correct version: build the attribute dict, map it to OTLP AnyValues and let
`json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=True)` serialize it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.record import (
    K_DNS_NAME,
    K_LABELS,
    SEVERITY_INFO,
    SEVERITY_WARN,
    Record,
    canonical_target,
    clean_str,
    state_attributes,
)


def _nested_key(key: Any) -> str:
    key = clean_str(str(key))
    return "_" + key if key.startswith("egressgate.chain.") else key


def clean_value(value: Any) -> Any:
    if isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str | bytes):
        return clean_str(value)
    if isinstance(value, Mapping):
        return {_nested_key(k): clean_value(v) for k, v in value.items()}
    if isinstance(value, Sequence | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return [clean_value(v) for v in items]
    return clean_str(str(value))


def event_attributes(event: AuditEvent) -> dict[str, Any]:
    pairs: dict[str, Any] = {
        "egressgate.operation": str(event.kind),
        "egressgate.request.id": event.request_id,
        "egressgate.sandbox.id": event.sandbox_id,
        "egressgate.decision": event.decision,
        "egressgate.reason": event.reason,
        "egressgate.rule": event.rule_id,
        "egressgate.policy.name": event.policy_name,
        "egressgate.policy.hash": event.policy_hash,
        "egressgate.target.as_sent": event.target_as_sent,
        "egressgate.target.canonical": canonical_target(event),
        "url.scheme": event.scheme,
        "server.address": event.host,
        "server.port": event.port,
        "http.request.method": event.method,
        "url.path": event.path,
        "url.query": event.query,
        "egressgate.dns.qtype": event.qtype,
        "egressgate.dns.answers": event.answers,
        "egressgate.pinned.address": event.pinned_address,
        "network.peer.address": event.pinned_address,
        "client.address": event.client_address,
        "http.response.status_code": event.status,
        "egressgate.bytes.out": event.bytes_out,
        "egressgate.bytes.in": event.bytes_in,
        "egressgate.duration_ms": event.duration_ms,
        "egressgate.capability": event.capability,
        "egressgate.key_id": event.key_id,
        "egressgate.request.hash": event.request_hash,
        "egressgate.body.hash": event.body_hash,
        "egressgate.message": event.message,
    }
    if event.kind is EventKind.DNS_QUERY and event.host:
        pairs[K_DNS_NAME] = event.host
    if event.sandbox_labels:
        pairs[K_LABELS] = dict(event.sandbox_labels)
    facts = event.facts
    if facts is not None:
        pairs["egressgate.facts.addresses"] = [str(a) for a in facts.addresses]
        pairs["egressgate.facts.request_bytes"] = facts.request_bytes
        if facts.op_class is not None:
            pairs["egressgate.operation.class"] = facts.op_class
            pairs["egressgate.operation.protocol"] = facts.op_protocol
        for key, val in (
            ("server.address", facts.host),
            ("server.port", facts.port),
            ("url.scheme", facts.scheme),
            ("http.request.method", facts.method),
            ("url.path", facts.path),
            ("egressgate.dns.qtype", facts.qtype),
        ):
            if pairs.get(key) is None:
                pairs[key] = val
    if event.state is not None:
        pairs.update(state_attributes(event.state))
    for key, val in event.extra.items():
        name = key if key.startswith("egressgate.") else f"egressgate.{key}"
        pairs.setdefault(name, val)
    return {clean_str(k): clean_value(v) for k, v in pairs.items() if v is not None}


def record_from_event(event: AuditEvent) -> Record:
    deny = event.decision == "deny"
    target = canonical_target(event) or ""
    parts = [event.decision or "", str(event.kind), target]
    if event.reason:
        parts.append(f"({event.reason})")
    return Record(
        time_ns=int(event.time_ns),
        severity_number=SEVERITY_WARN if deny else SEVERITY_INFO,
        severity_text="WARN" if deny else "INFO",
        event_name=f"egressgate.{event.kind}",
        body=clean_str(" ".join(p for p in parts if p)),
        attributes=event_attributes(event),
    )


def any_value(value: Any) -> dict[str, Any]:
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


def key_values(attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": any_value(attrs[k])} for k in sorted(attrs)]


def encode_record(record: Record) -> bytes:
    log_record = {
        "timeUnixNano": str(record.time_ns),
        "observedTimeUnixNano": str(record.time_ns),
        "severityNumber": record.severity_number,
        "severityText": record.severity_text,
        "eventName": record.event_name,
        "body": {"stringValue": record.body},
        "attributes": key_values(record.attributes),
    }
    doc = {
        "resourceLogs": [
            {
                "resource": {"attributes": key_values({"service.name": "egressgate"})},
                "scopeLogs": [{"scope": {"name": "egressgate.audit", "version": "1"}, "logRecords": [log_record]}],
            }
        ]
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
