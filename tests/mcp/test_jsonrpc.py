"""The strict JSON-RPC parser: every input two parsers could read differently is refused with a specific
detail, and its legal neighbour (one byte or one member away) parses — so each refusal is the rule
working, not the parser rejecting everything."""

from __future__ import annotations

import json

import pytest

from egressgate.mcp.jsonrpc import (
    INVALID_REQUEST,
    PARSE_ERROR,
    McpMalformed,
    deny_error,
    dumps,
    malformed_error,
    parse_body,
)

MAX = 1 << 20
CALL = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search","arguments":{"q":"a"}}}'

# (id, bad body, expected detail, legal neighbour)
CASES = [
    ("duplicate_top", b'{"jsonrpc":"2.0","id":1,"id":2,"method":"ping"}', "duplicate_key",
     b'{"jsonrpc":"2.0","id":1,"method":"ping"}'),
    ("duplicate_name", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search",'
     b'"name":"delete"}}', "duplicate_key",
     b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search"}}'),
    ("duplicate_deep", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"s","arguments":'
     b'{"a":{"b":[{"c":1,"c":2}]}}}}', "duplicate_key",
     b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"s","arguments":{"a":{"b":[{"c":1,"d":2}]}}}}'),
    ("duplicate_escaped", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"s","n\\u0061me":"d"}}',
     "duplicate_key", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"s"}}'),
    ("latin1", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\xe9"}}', "not_utf8",
     '{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\xe9"}}'.encode()),
    ("utf8_surrogate", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\xed\xa0\x80"}}', "not_utf8",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\xf0\x9f\x98\x80"}}'),
    ("overlong", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\xc0\xaf"}}', "not_utf8",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"/"}}'),
    ("bom", b'\xef\xbb\xbf{"jsonrpc":"2.0","id":1,"method":"ping"}', "bom",
     b'{"jsonrpc":"2.0","id":1,"method":"ping"}'),
    ("utf16", '{"jsonrpc":"2.0","id":1,"method":"ping"}'.encode("utf-16"), "not_utf8",
     b'{"jsonrpc":"2.0","id":1,"method":"ping"}'),
    ("lone_high_escape", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\\ud800"}}', "surrogate",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\\ud83d\\ude00"}}'),
    ("lone_low_escape_upper", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"a\\uDC00"}}', "surrogate",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"a\\\\uDC00"}}'),
    ("surrogate_in_key", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"\\udfff":1}}', "surrogate",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"\\u00ff":1}}'),
    ("nan", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":NaN}}', "non_finite",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"NaN"}}'),
    ("infinity", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":-Infinity}}', "non_finite",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":-1e308}}'),
    ("overflow", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":1e400}}', "non_finite",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":1e300}}'),
    ("depth", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":' + b"[" * 63 + b"]" * 63 + b"}}", "depth",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":' + b"[" * 62 + b"]" * 62 + b"}}"),
    ("control_char", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"a\nb"}}',  # a raw newline inside a string
     "syntax", b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"a\\nb"}}'),
    ("trailing", b'{"jsonrpc":"2.0","id":1,"method":"ping"} {"jsonrpc":"2.0","id":2,"method":"tools/call"}',
     "syntax", b'{"jsonrpc":"2.0","id":1,"method":"ping"} '),
    ("scalar", b'"ping"', "not_object", b'{"jsonrpc":"2.0","method":"notifications/initialized"}'),
    ("empty_batch", b"[]", "empty_batch", b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]'),
    ("batch_member", b'[{"jsonrpc":"2.0","id":1,"method":"ping"},1]', "batch_member",
     b'[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":2,"method":"ping"}]'),
    ("nested_batch", b'[[{"jsonrpc":"2.0","id":1,"method":"ping"}]]', "batch_member",
     b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]'),
    ("version", b'{"jsonrpc":"2.1","id":1,"method":"ping"}', "jsonrpc_version",
     b'{"jsonrpc":"2.0","id":1,"method":"ping"}'),
    ("version_number", b'{"jsonrpc":2.0,"id":1,"method":"ping"}', "jsonrpc_version",
     b'{"jsonrpc":"2.0","id":1,"method":"ping"}'),
    ("version_missing", b'{"id":1,"method":"ping"}', "jsonrpc_version", b'{"jsonrpc":"2.0","id":1,"method":"ping"}'),
    ("unknown_member", b'{"jsonrpc":"2.0","id":1,"method":"ping","tool":"delete"}', "unknown_member",
     b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"tool":"delete"}}'),
    ("id_float", b'{"jsonrpc":"2.0","id":1.0,"method":"ping"}', "id_type", b'{"jsonrpc":"2.0","id":1,"method":"ping"}'),
    ("id_bool", b'{"jsonrpc":"2.0","id":true,"method":"ping"}', "id_type",
     b'{"jsonrpc":"2.0","id":"true","method":"ping"}'),
    ("id_unsafe_int", b'{"jsonrpc":"2.0","id":9007199254740993,"method":"ping"}', "id_type",
     b'{"jsonrpc":"2.0","id":9007199254740991,"method":"ping"}'),
    ("id_null", b'{"jsonrpc":"2.0","id":null,"method":"ping"}', "id_type", b'{"jsonrpc":"2.0","method":"ping"}'),
    ("id_object", b'{"jsonrpc":"2.0","id":{},"method":"ping"}', "id_type",
     b'{"jsonrpc":"2.0","id":"{}","method":"ping"}'),
    ("result_on_request", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"s"},"result":{}}',
     "result_on_request", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"s"}}'),
    ("error_on_notification", b'{"jsonrpc":"2.0","method":"ping","error":{"code":1,"message":"x"}}',
     "result_on_request", b'{"jsonrpc":"2.0","method":"ping"}'),
    ("method_on_response", b'{"jsonrpc":"2.0","id":1,"result":{},"method":null}', "method_on_response",
     b'{"jsonrpc":"2.0","id":1,"result":{}}'),
    ("params_on_response", b'{"jsonrpc":"2.0","id":1,"result":{},"params":{}}', "params_on_response",
     b'{"jsonrpc":"2.0","id":1,"result":{}}'),
    ("result_and_error", b'{"jsonrpc":"2.0","id":1,"result":{},"error":{"code":1,"message":"x"}}',
     "response_shape", b'{"jsonrpc":"2.0","id":1,"error":{"code":1,"message":"x"}}'),
    ("error_shape", b'{"jsonrpc":"2.0","id":1,"error":{"code":"1","message":"x"}}', "error_shape",
     b'{"jsonrpc":"2.0","id":null,"error":{"code":1,"message":"x"}}'),
    ("method_type", b'{"jsonrpc":"2.0","id":1,"method":["tools/call"]}', "method_type",
     b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}'),
    ("params_array", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":["search"]}', "params_type",
     b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search"}}'),
    ("call_notification", b'{"jsonrpc":"2.0","method":"tools/call","params":{"name":"search"}}',
     "call_notification", b'{"jsonrpc":"2.0","id":"n","method":"tools/call","params":{"name":"search"}}'),
    ("call_no_name", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{}}}', "call_params",
     b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{}}}'),
    ("call_args_string", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":"{}"}}',
     "call_params", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{}}}'),
    ("call_extra_param", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","tool":"y"}}',
     "call_params_member", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","_meta":{}}}'),
    ("batch_same_id", b'[' + CALL + b',' + CALL.replace(b'"search"', b'"delete"') + b']', "duplicate_id",
     b'[' + CALL + b',' + CALL.replace(b'"search"', b'"delete"').replace(b'"id":1', b'"id":2') + b']'),
    ("batch_one_bad", b'[' + CALL + b',{"jsonrpc":"2.0","method":"tools/call","params":{"name":"delete"}}]',
     "call_notification", b'[' + CALL + b',{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"delete"}}]'),
]


@pytest.mark.parametrize(("bad", "detail", "good"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_detail_and_legal_neighbour_parses(bad: bytes, detail: str, good: bytes) -> None:
    with pytest.raises(McpMalformed) as info:
        parse_body(bad, max_bytes=MAX)
    assert info.value.detail == detail, info.value
    messages, _ = parse_body(good, max_bytes=MAX)  # positive control
    assert messages


def test_json_failures_are_parse_errors_and_envelope_failures_invalid_requests() -> None:
    with pytest.raises(McpMalformed) as info:
        parse_body(b'{"a":1,"a":2}', max_bytes=MAX)
    assert info.value.code == PARSE_ERROR
    with pytest.raises(McpMalformed) as info:
        parse_body(b'{"jsonrpc":"2.0","id":1,"method":"ping","x":1}', max_bytes=MAX)
    assert info.value.code == INVALID_REQUEST


def test_size_limit_is_exact() -> None:
    body = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"p":"' + b"a" * 100 + b'"}}'
    parse_body(body, max_bytes=len(body))
    with pytest.raises(McpMalformed) as info:
        parse_body(body, max_bytes=len(body) - 1)
    assert info.value.detail == "too_large"


def test_very_deep_document_is_depth_not_a_crash() -> None:
    body = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(McpMalformed) as info:
        parse_body(body, max_bytes=1 << 21)
    assert info.value.detail == "depth"


def test_huge_integer_is_refused_not_slow() -> None:
    with pytest.raises(McpMalformed) as info:
        parse_body(b'{"jsonrpc":"2.0","id":' + b"9" * 5000 + b',"method":"ping"}', max_bytes=MAX)
    assert info.value.detail == "syntax"


def test_kinds_and_fields() -> None:
    body = (b'[' + CALL + b',{"jsonrpc":"2.0","method":"notifications/initialized"},'
            b'{"jsonrpc":"2.0","id":"s1","result":{"roots":[]}},'
            b'{"jsonrpc":"2.0","id":"s2","error":{"code":-1,"message":"no"}}]')
    messages, was_batch = parse_body(body, max_bytes=MAX)
    assert was_batch
    assert [m.kind for m in messages] == ["request", "notification", "response", "response"]
    call = messages[0]
    assert call.is_call and call.id == 1 and call.params["name"] == "search"
    assert messages[2].result == {"roots": []} and messages[3].error["code"] == -1
    single, was_batch = parse_body(CALL, max_bytes=MAX)
    assert not was_batch and single[0].obj == json.loads(CALL)


def test_dumps_is_what_was_parsed_and_reparses_identically() -> None:
    body = ('{"jsonrpc":"2.0","id":1,"method":"tools/call",'
            '"params":{"name":"s","arguments":{"q":"\\u00e9\\n","z":1,"a":2}}}')
    messages, _ = parse_body(body.encode(), max_bytes=MAX)
    out = dumps(messages[0].obj)
    assert out == ('{"jsonrpc":"2.0","id":1,"method":"tools/call",'
                   '"params":{"name":"s","arguments":{"q":"é\\n","z":1,"a":2}}}').encode()
    again, _ = parse_body(out, max_bytes=MAX)
    assert again[0].obj == messages[0].obj


def test_error_shapes() -> None:
    err = deny_error(7, "Tool x is not allowed.", "mcp_tool_denied", "mcp:t/x", approval_id="apr-0123456789abcdef")
    assert err == {"jsonrpc": "2.0", "id": 7, "error": {"code": -32001, "message": "Tool x is not allowed.", "data": {
        "reason": "mcp_tool_denied", "rule": "mcp:t/x", "egressgate": True, "approval_id": "apr-0123456789abcdef"}}}
    try:
        parse_body(b"{", max_bytes=MAX)
    except McpMalformed as exc:
        out = malformed_error(exc)
    assert out["error"]["code"] == PARSE_ERROR and out["error"]["data"]["reason"] == "mcp_malformed"
    parse_body(dumps(out), max_bytes=MAX)  # our own error is a valid response
