"""Hostile admin API bodies against the real gateway: each is a 4xx with a JSON reason, never a 500, and
nothing is admitted. Positive control: the same request with a clean body admits a sandbox."""

from __future__ import annotations

import httpx
import pytest

from egressgate.admin.jsonbody import MAX_BODY, json_depth, parse_object


def post(gw, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(f"http://{gw.admin}/v1/sandboxes", content=body, timeout=10, trust_env=False,
                      headers={"Authorization": f"Bearer {gw.token}", "Content-Type": "application/json",
                               **headers})


HOSTILE = {
    # json.loads recurses once per level: RecursionError → 500 on the old code
    "deep_list": (b'{"policy": "gw-basic", "labels": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "invalid_json"),
    "deep_object": (b'{"policy": "gw-basic", "labels": ' + b'{"a":' * 5000 + b"1" + b"}" * 5001, 400,
                    "invalid_json"),
    # two `policy` keys: the old code silently took the last one and admitted
    "duplicate_key": (b'{"policy": "no-such-policy", "policy": "gw-basic"}', 400, "invalid_json"),
    "nan": (b'{"policy": "gw-basic", "labels": {"a": NaN}}', 400, "invalid_json"),
    "bad_utf8": (b'{"policy": "gw-basic", "labels": {"a": "\xff\xfe"}}', 400, "invalid_encoding"),
    "lone_surrogate": (b'{"policy": "gw-basic", "labels": {"a": "\\ud800"}}', 400, "invalid_encoding"),
    "top_level_list": (b'["gw-basic"]', 400, "invalid_request"),
    "top_level_string": (b'"gw-basic"', 400, "invalid_request"),
    "truncated": (b'{"policy": "gw-ba', 400, "invalid_json"),
    "too_large": (b'{"policy": "gw-basic", "labels": {"a": "' + b"x" * MAX_BODY + b'"}}', 413, "body_too_large"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_admin_body_is_a_4xx_with_json_reason(gateway, name):
    body, status, error = HOSTILE[name]
    before = len([r for r in gateway.audit_records() if r.get("egressgate.operation") == "admission"])
    res = post(gateway, body)
    assert res.status_code == status, res.text
    assert res.headers["content-type"].startswith("application/json")
    data = res.json()
    assert data["error"] == error and data["message"]
    after = len([r for r in gateway.audit_records() if r.get("egressgate.operation") == "admission"])
    assert after == before  # nothing admitted


def test_chunked_too_large_body_is_413(gateway):
    """No Content-Length: the bound holds while reading, not only on the header."""
    def chunks():
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024
    res = httpx.post(f"http://{gateway.admin}/v1/sandboxes", content=chunks(), timeout=10, trust_env=False,
                     headers={"Authorization": f"Bearer {gateway.token}"})
    assert res.status_code == 413 and res.json()["error"] == "body_too_large"


def test_clean_body_admits_and_other_errors_are_json(gateway):
    res = post(gateway, b'{"policy": "gw-basic", "labels": {"team": "a"}}')
    assert res.status_code == 201, res.text
    assert res.json()["id"].startswith("sbx-")
    wrong = httpx.put(f"http://{gateway.admin}/v1/sandboxes", timeout=10, trust_env=False,
                      headers={"Authorization": f"Bearer {gateway.token}"})
    assert wrong.status_code == 405 and wrong.json()["error"] == "method_not_allowed"
    missing = httpx.get(f"http://{gateway.admin}/v1/nothing", timeout=10, trust_env=False,
                        headers={"Authorization": f"Bearer {gateway.token}"})
    assert missing.status_code == 404 and missing.json()["error"] == "unknown_route"


def test_depth_scan_ignores_brackets_in_strings():
    assert json_depth('{"a": "[[[[{{{{\\"[[["}') == 1
    assert json_depth("[[[]]]") == 3
    assert parse_object(b'{"policy": "' + b"[" * 100 + b'"}') == {"policy": "[" * 100}
