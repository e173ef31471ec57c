"""Records are valid OTLP/JSON and hostile strings stay inside their attribute."""

from __future__ import annotations

import json

import pytest
from google.protobuf.json_format import Parse
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from egressgate.audit.chain import ChainWriter
from egressgate.audit.encode import encode_record
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.record import parse_line, record_from_event
from egressgate.policy.facts import Facts, Operation, RuleUsage, SandboxState
from tests.support.audit_events import http_event

HOSTILE = [
    'evil.com\r\n{"resourceLogs":[]}',
    "\x1b[2J\x1b[31mFAKE OK\x1b[0m",
    'quote"s and \\backslash',
    "nul\x00byte",
    "lone surrogate \udcff and \ud800",
    "unicode \u2028 line sep \u0085 nel ünï",
]


def _attrs(pb_record):
    return {kv.key: kv.value for kv in pb_record.attributes}


def test_each_line_parses_as_export_logs_service_request():
    ev = http_event(1, status=200, bytes_in=5, request_hash="sha256:" + "0" * 64)
    line = ChainWriter().append(record_from_event(ev))
    msg = Parse(line.decode(), ExportLogsServiceRequest())
    assert len(msg.resource_logs) == 1
    rec = msg.resource_logs[0].scope_logs[0].log_records[0]
    assert msg.resource_logs[0].scope_logs[0].scope.name == "egressgate.audit"
    assert rec.time_unix_nano == ev.time_ns
    assert rec.severity_number == 9
    a = _attrs(rec)
    assert a["http.request.method"].string_value == "POST"
    assert a["server.address"].string_value == "api.openai.com"
    assert a["server.port"].int_value == 443
    assert a["url.path"].string_value == "/v1/responses"
    assert a["url.scheme"].string_value == "https"
    assert a["network.peer.address"].string_value == "198.18.0.10"
    assert a["http.response.status_code"].int_value == 200
    assert a["egressgate.decision"].string_value == "allow"
    assert a["egressgate.rule"].string_value == "openai"
    assert a["egressgate.chain.seq"].int_value == 0
    labels = {kv.key: kv.value.string_value for kv in a["egressgate.sandbox.labels"].kvlist_value.values}
    assert labels == {"team": "finance"}
    # OTLP/JSON profile: lowerCamelCase keys, int64 as strings, integer enums
    doc = json.loads(line)
    lr = doc["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]
    assert isinstance(lr["timeUnixNano"], str) and isinstance(lr["severityNumber"], int)


def test_deny_is_warn_severity():
    rec = record_from_event(http_event(2, decision="deny", reason="path_not_allowed"))
    assert rec.severity_number == 13 and "path_not_allowed" in rec.body


def test_hostile_strings_stay_inside_their_attribute():
    for i, bad in enumerate(HOSTILE):
        ev = http_event(
            i,
            host=bad,
            path="/" + bad,
            target_as_sent=bad.encode("utf-8", "surrogatepass"),
            sandbox_labels={bad: bad},
            extra={"note": bad},
        )
        line = ChainWriter().append(record_from_event(ev))
        assert b"\n" not in line and b"\r" not in line and b"\x1b" not in line and b"\x00" not in line
        assert line.isascii()
        msg = Parse(line.decode(), ExportLogsServiceRequest())  # strict UTF-8 parser accepts it
        a = _attrs(msg.resource_logs[0].scope_logs[0].log_records[0])
        got = a["server.address"].string_value
        if "\udcff" in bad:
            assert got == bad.replace("\udcff", "\\udcff").replace("\ud800", "\\ud800")
        else:
            assert got == bad  # exact round trip, nothing spilled into another attribute
        assert a["egressgate.note"].string_value == got
        assert set(a) >= {"egressgate.chain.hash", "egressgate.decision"}
        assert a["egressgate.decision"].string_value == "allow"


def test_invalid_utf8_bytes_become_visible_escapes():
    ev = http_event(1, target_as_sent=b"GET /\xff\xfe\r\nX-Injected: 1")
    rec = parse_line(encode_record(record_from_event(ev)))
    assert rec.attributes["egressgate.target.as_sent"] == "GET /\\xff\\xfe\r\nX-Injected: 1"


def test_recorded_facts_and_state_round_trip():
    import ipaddress

    facts = Facts(
        Operation.HTTP_REQUEST,
        "api.openai.com",
        443,
        "https",
        "POST",
        "/v1/responses",
        (ipaddress.ip_address("198.18.0.10"), ipaddress.ip_address("2001:db8::1")),
        request_bytes=77,
    )
    state = SandboxState(
        "sbx-1",
        1_795_000_000.5,
        {"team": "finance"},
        bytes_out=10,
        bytes_in=20,
        dns_queries=3,
        dns_name_bytes=40,
        seen_hosts=frozenset({"b.example", "a.example"}),
        rule_usage={"openai": RuleUsage(2, 300)},
    )
    ev = AuditEvent(EventKind.HTTP_REQUEST, 1, "r", sandbox_id="sbx-1", decision="allow", facts=facts, state=state)
    a = parse_line(encode_record(record_from_event(ev))).attributes
    assert a["server.address"] == "api.openai.com" and a["url.path"] == "/v1/responses"
    assert a["egressgate.facts.addresses"] == ["198.18.0.10", "2001:db8::1"]
    assert a["egressgate.facts.request_bytes"] == 77
    assert a["egressgate.state.admitted_at"] == 1_795_000_000.5
    assert a["egressgate.state.seen_hosts"] == ["a.example", "b.example"]
    assert a["egressgate.state.rule_usage"] == {"openai": {"requests": 2, "bytes": 300}}


def test_no_secret_value_fields_exist():
    """The event has no field for a credential value; only capability names and key ids are recorded."""
    secret = "sk-live-SECRET-VALUE-123"
    ev = http_event(1, capability="openai", key_id="kid-1")
    line = encode_record(record_from_event(ev))
    assert secret.encode() not in line
    assert not any("secret" in f or "token" in f or "value" in f for f in AuditEvent.__dataclass_fields__)


def test_labels_cannot_imitate_chain_fields():
    from egressgate.audit.chain import compute_line_hash, recorded_line_hash

    ev = http_event(
        1,
        sandbox_labels={"egressgate.chain.hash": "f" * 64, "egressgate.chain.seq": "9"},
        extra={"egressgate.chain.hash": "0" * 64},
    )
    line = ChainWriter().append(record_from_event(ev))
    assert compute_line_hash(line) == recorded_line_hash(line)
    a = parse_line(line).attributes
    assert a["egressgate.sandbox.labels"] == {"_egressgate.chain.hash": "f" * 64, "_egressgate.chain.seq": "9"}
    assert a["egressgate.chain.seq"] == 0 and a["egressgate.chain.hash"] == recorded_line_hash(line)


def _oracle_cases():
    import ipaddress
    from enum import IntEnum

    from egressgate.policy.reasons import Reason

    class Num(IntEnum):
        FIVE = 5

    facts = Facts(
        Operation.DNS_QUERY, "a.example", scheme="dns", qtype="A", addresses=(ipaddress.ip_address("2001:db8::1"),)
    )
    state = SandboxState(
        "sbx-1",
        1_795_000_000.25,
        {"k": "v"},
        dns_queries=3,
        dns_name_bytes=40,
        seen_hosts=frozenset({"z.example", "a.example"}),
        rule_usage={"r": RuleUsage(1, 2)},
    )
    yield http_event(1)
    yield http_event(2, decision="deny", reason=Reason.HOST_NOT_ALLOWED, status=403, duration_ms=1.5)
    yield AuditEvent(
        EventKind.DNS_QUERY,
        7,
        "d",
        sandbox_id="s",
        decision="deny",
        host="a.example",
        qtype="A",
        answers=[],
        facts=facts,
        state=state,
        extra={"egressgate.dns.rcode": "NXDOMAIN"},
    )
    yield http_event(
        3,
        duration_ms=float("nan"),
        bytes_in=Num.FIVE,
        extra={
            "note": b"\xff\xfe",
            "egressgate.note": "second spelling loses",
            "message": "never overrides",
            "egressgate.decision": "never overrides",
            "ratio": float("inf"),
            "set": {"b", "a"},
            "tuple": (1, "x"),
            "nested": {"egressgate.chain.hash": "0" * 64, 3: [True, 2.5, None]},
            "none": None,
            "obj": ipaddress.ip_address("192.0.2.1"),
        },
    )
    yield http_event(4, message=None, extra={"egressgate.message": "not overridden even when None"})
    yield http_event(5, facts=facts, host=None, scheme=None, port=None, path=None, method=None)
    for i, bad in enumerate(HOSTILE):
        yield http_event(
            10 + i,
            host=bad,
            path="/" + bad,
            target_as_sent=bad.encode("utf-8", "surrogatepass"),
            sandbox_labels={bad: bad, "egressgate.chain.seq": "x"},
            extra={bad: bad, "note": bad},
        )


def test_fast_encoder_is_byte_identical_to_the_json_dumps_oracle():
    """The record format is a contract (the chain hashes the exact bytes): the fast path must produce exactly
    what building the dicts and calling json.dumps(sort_keys=True, ensure_ascii=True) produces."""
    from tests.audit import reference_encoding as oracle

    cases = list(_oracle_cases())
    assert len(cases) > 10
    for ev in cases:
        fast, slow = record_from_event(ev), oracle.record_from_event(ev)
        assert fast == slow, ev
        assert encode_record(fast) == oracle.encode_record(slow)
        chained = ChainWriter(prev="ab" * 32).append(fast)  # append() stores the final hash in the record
        assert chained == oracle.encode_record(fast)


def test_fast_encoder_falls_back_for_unusual_values():
    from egressgate.audit.record import Record, dumps, to_otlp

    class S(str):
        pass

    rec = Record(1, 9, "INFO", "egressgate.x", "b", {"a": S("sub"), "b": {"k": [1, 2.0, False]}, "c": -3})
    assert encode_record(rec) == dumps(to_otlp(rec))
    with pytest.raises(ValueError):
        encode_record(Record(1, 9, "INFO", "e", "b", {"x": float("nan")}))  # JSON has no NaN (allow_nan=False)
