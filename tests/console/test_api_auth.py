"""The console's front door against a real gateway (`egressgate run`) with real traffic: role tokens,
sessions, CSRF + Origin, the Host check, security headers on every /ui response, static files (no
traversal), roles on mutating routes, and the live feed."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.console.apiworld import ConsoleClient, LiveStream, role_token
from tests.control_api.harness import METRICS_POLICY, start_control_gateway
from tests.support.gwworld import Gateway, World, open_world
from tests.support.launcher import stop_gateway
from tests.support.replicas import hold_sse
from tests.support.waiting import wait_for

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "font-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
           "cache-control": "no-store", "x-frame-options": "DENY"}
# every console API route: (method, path, needs operator)
API_ROUTES = [
    ("GET", "/ui/api/session", False), ("POST", "/ui/api/logout", False), ("GET", "/ui/api/live", False),
    ("GET", "/ui/api/sandboxes", False), ("GET", "/ui/api/sandboxes/sbx-ffffffffffffffff", False),
    ("DELETE", "/ui/api/sandboxes/sbx-ffffffffffffffff", True), ("GET", "/ui/api/approvals", False),
    ("POST", "/ui/api/approvals/x/approve", True), ("POST", "/ui/api/approvals/x/deny", True),
    ("POST", "/ui/api/request-hash", False), ("POST", "/ui/api/explain", False),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("uiworld")) as w:
        yield w


@pytest.fixture(scope="module")
def gw(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_control_gateway(world, tmp_path_factory.mktemp("uigw"))
    try:
        yield g
    finally:
        stop_gateway(g)


@pytest.fixture
def operator(gw: Gateway) -> Iterator[ConsoleClient]:
    c = ConsoleClient(gw, "operator")
    yield c
    c.close()


@pytest.fixture
def auditor(gw: Gateway) -> Iterator[ConsoleClient]:
    c = ConsoleClient(gw, "auditor")
    yield c
    c.close()


def assert_secure(res: httpx.Response) -> None:
    for name, value in HEADERS.items():
        assert res.headers.get(name) == value, (res.request.method, res.request.url, res.status_code, name)


def raw_get(gw: Gateway, target: str, host: str | None = None, cookie: str = "") -> tuple[int, bytes]:
    """One GET with the request-target exactly as given (no client-side normalization of `..`/%2e)."""
    extra = f"Cookie: egressgate_console={cookie}\r\n" if cookie else ""
    with socket.create_connection(tuple(gw.admin.rsplit(":", 1)), timeout=5) as s:  # type: ignore[arg-type]
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host or gw.admin}\r\n{extra}Connection: close\r\n\r\n"
                  .encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), head + b"\r\n\r\n" + body


def test_role_tokens_are_private_distinct_and_not_the_admin_token(gw):
    tokens = {role: role_token(gw, role) for role in ("operator", "auditor")}
    for role in tokens:
        assert stat.S_IMODE(os.stat(gw.var / f"console-{role}.token").st_mode) == 0o600
    assert len({*tokens.values(), gw.token}) == 3 and all(len(t) >= 40 for t in tokens.values())


def test_login_sets_a_strict_http_only_session_cookie(gw):
    c = ConsoleClient(gw)
    try:
        res = c.login("auditor")
        cookie = res.headers["set-cookie"]
        parts = [p.strip().lower() for p in cookie.split(";")]
        name, _, value = cookie.split(";")[0].partition("=")
        assert name == "egressgate_console" and len(value) >= 43  # 256 random bits, url-safe base64
        assert "httponly" in parts and "samesite=strict" in parts and "path=/ui" in parts
        assert role_token(gw, "auditor") not in cookie  # the session id, never the token
        body = res.json()
        assert body["role"] == "auditor" and len(body["csrf"]) >= 43
        assert c.get("/ui/api/session").json() == body
        # no session file holds the session id itself (files are named by its SHA-256)
        files = list((gw.var / "console-sessions").iterdir())
        assert files and all(value not in f.name and value not in f.read_text() for f in files)
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    finally:
        c.close()


@pytest.mark.parametrize(("method", "path", "_op"), API_ROUTES)
def test_every_api_route_needs_a_session_and_the_admin_token_is_not_one(gw, operator, method, path, _op):
    anon = ConsoleClient(gw)
    try:
        res = anon.request(method, path, json={} if method == "POST" else None)
        assert res.status_code == 401 and res.json()["error"] == "unauthorized", res.text
        assert_secure(res)
        bearer = anon.request(method, path, headers={"Authorization": f"Bearer {gw.token}"},
                              json={} if method == "POST" else None)
        assert bearer.status_code == 401
    finally:
        anon.close()
    if path != "/ui/api/live" and path != "/ui/api/logout":  # positive control: a session gets past the guard
        res = operator.request(method, path, json={} if method == "POST" else None)
        assert res.status_code != 401, res.text


def test_a_console_session_does_not_open_the_admin_api(gw, operator):
    res = operator.http.get("/v1/sandboxes")
    assert res.status_code == 401
    assert httpx.get(f"http://{gw.admin}/v1/sandboxes", headers={"Authorization": f"Bearer {gw.token}"},
                     trust_env=False).status_code == 200


@pytest.mark.parametrize("target", ["/ui/../v1/sandboxes", "/ui/%2e%2e/v1/sandboxes", "/ui/api/../../v1/sandboxes",
                                    "/ui/static/%2e%2e/%2e%2e/v1/sandboxes", "/ui/..%2fv1/sandboxes"])
def test_a_console_path_never_reaches_the_admin_api_without_the_token(gw, operator, target):
    """The bearer check is skipped only for the console's own routes (the route that matched), never by
    a path that starts with /ui and resolves elsewhere."""
    status, raw = raw_get(gw, target, cookie=operator.http.cookies["egressgate_console"])
    assert status in (400, 401, 404), (target, status, raw[:300])
    assert b'"sandboxes"' not in raw
    sid = gw.admit(METRICS_POLICY).id  # positive control: with the admin token the list has it
    listed = httpx.get(f"http://{gw.admin}/v1/sandboxes", headers={"Authorization": f"Bearer {gw.token}"},
                       trust_env=False)
    assert sid in listed.text


def test_login_with_a_wrong_token_is_401_and_repeated_failures_are_rate_limited(gw):
    transport = httpx.HTTPTransport(local_address="127.0.0.77")  # its own client address: its own budget
    with httpx.Client(base_url=f"http://{gw.admin}", transport=transport, trust_env=False, timeout=10) as c:
        origin = {"Origin": f"http://{gw.admin}"}
        codes = [c.post("/ui/api/login", json={"token": "x" * 43}, headers=origin).status_code for _ in range(10)]
        assert codes == [401] * 10
        res = c.post("/ui/api/login", json={"token": role_token(gw, "operator")}, headers=origin)
        assert res.status_code == 429 and res.headers["retry-after"] and res.json()["error"] == "too_many_requests"
        assert_secure(res)
    # another client address is not locked out
    other = ConsoleClient(gw)
    try:
        assert other.login("operator").status_code == 200
    finally:
        other.close()


def test_login_needs_the_console_origin(gw):
    c = ConsoleClient(gw)
    try:
        token = role_token(gw, "operator")
        for origin in (None, "http://evil.example", f"https://{gw.admin}", "null"):
            res = c.post("/ui/api/login", json={"token": token}, origin=origin, csrf=None)
            assert res.status_code == 403 and res.json()["error"] == "forbidden", (origin, res.text)
            assert "set-cookie" not in res.headers
        assert c.post("/ui/api/login", json={"token": token}, csrf=None).status_code == 200  # positive control
    finally:
        c.close()


@pytest.mark.parametrize("case", ["missing", "wrong", "other-session", "cross-origin", "no-origin"])
def test_state_changing_requests_need_csrf_token_and_origin(gw, auditor, case):
    other = ConsoleClient(gw, "auditor")
    try:
        kw = {"missing": {"csrf": None}, "wrong": {"csrf": "A" * 43}, "other-session": {"csrf": other.csrf},
              "cross-origin": {"origin": "http://evil.example"}, "no-origin": {"origin": None}}[case]
        body = {"method": "GET", "url": "https://api.test/echo"}
        res = auditor.post("/ui/api/request-hash", json=body, **kw)
        assert res.status_code == 403 and res.json()["error"] == "forbidden", res.text
        assert_secure(res)
        assert auditor.post("/ui/api/request-hash", json=body).status_code == 200  # positive control
        # logout is state-changing too: refused the same way, the session survives
        assert auditor.post("/ui/api/logout", **kw).status_code == 403
        assert auditor.get("/ui/api/session").status_code == 200
    finally:
        other.close()


def test_logout_ends_the_session_on_the_server(gw):
    c = ConsoleClient(gw, "operator")
    try:
        sid = c.http.cookies["egressgate_console"]
        res = c.post("/ui/api/logout")
        assert res.status_code == 200 and "max-age=0" in res.headers["set-cookie"].lower()
        replay = httpx.get(f"http://{gw.admin}/ui/api/session", cookies={"egressgate_console": sid},
                           trust_env=False)
        assert replay.status_code == 401  # the old cookie, replayed by hand, no longer works
    finally:
        c.close()


def test_a_foreign_host_header_is_refused(gw, operator):
    """DNS rebinding: a page on evil.example rebound to 127.0.0.1 reaches the listener with its own Host."""
    status, raw = raw_get(gw, "/ui/", host=f"evil.example:{gw.admin.rsplit(':', 1)[1]}")
    assert status == 403 and CSP.encode() in raw
    res = operator.http.get("/ui/api/session", headers={"Host": "evil.example"})
    assert res.status_code == 403
    port = gw.admin.rsplit(":", 1)[1]
    assert raw_get(gw, "/ui/", host=f"localhost:{port}")[0] == 200  # positive controls
    assert operator.get("/ui/api/session").status_code == 200


def test_every_console_response_carries_the_security_headers(gw, operator):
    anon = ConsoleClient(gw)
    try:
        responses = [
            anon.get("/ui/"), anon.get("/ui/static/app.js"), anon.get("/ui/static/nope.js"),
            anon.get("/ui/api/session"), anon.get("/ui/api/no-such-route"), anon.request("PUT", "/ui/api/session"),
            anon.post("/ui/api/login", json={"token": "short"}), anon.post("/ui/api/login", content=b"{"),
            operator.get("/ui/api/sandboxes/sbx-ffffffffffffffff"), operator.post("/ui/api/explain", json={}),
            anon.http.get("/ui", follow_redirects=False),
        ]
        for res in responses:
            assert_secure(res)
        assert [r.status_code for r in responses] == [200, 200, 404, 401, 404, 405, 401, 400, 404, 400, 302]
        assert responses[0].headers["content-type"].startswith("text/html")
        assert responses[1].headers["content-type"].startswith("text/javascript")
        assert responses[-1].headers["location"] == "/ui/"
        for res in responses[2:-1]:
            assert res.headers["content-type"].startswith("application/json") and res.json()["error"]
        # the admin API's own responses are unchanged (no console headers on /v1)
        v1 = httpx.get(f"http://{gw.admin}/healthz", trust_env=False)
        assert "content-security-policy" not in v1.headers
    finally:
        anon.close()


@pytest.mark.parametrize("target", [
    "/ui/static/..%2f..%2fadmin.token", "/ui/static/..%2F..%2F..%2Fvar%2Fadmin.token",
    "/ui/static/%2e%2e/%2e%2e/%2e%2e/admin.token", "/ui/static/%2e%2e%2f%2e%2e%2fserver.py",
    "/ui/static/../routes.py", "/ui/static/../../server.py", "/ui/static//etc/passwd",
    "/ui/static/%2fetc%2fpasswd", "/ui/static/..\\..\\server.py", "/ui/static/.%2e/routes.py",
    "/ui/static/app.js%00.html", "/ui/static/./app.js/../../routes.py",
])
def test_static_files_cannot_be_escaped(gw, target):
    status, raw = raw_get(gw, target)
    assert status in (400, 404), (target, status, raw[:300])
    assert gw.token.encode() not in raw and b"root:" not in raw and b"import" not in raw
    assert raw_get(gw, "/ui/static/app.js")[0] == 200  # positive control: an allowlisted file is served


def test_auditor_cannot_revoke_or_decide_and_the_sandbox_keeps_working(gw, auditor):
    sbx = gw.admit(METRICS_POLICY)
    with sbx.client() as c:
        assert c.get(sbx.url("api.test", "/echo")).status_code == 200
    res = auditor.delete(f"/ui/api/sandboxes/{sbx.id}")
    assert res.status_code == 403 and res.json()["error"] == "forbidden", res.text
    for action in ("approve", "deny"):
        res = auditor.post(f"/ui/api/approvals/apr-x/{action}", json={})
        assert res.status_code == 403 and res.json()["error"] == "forbidden"
    detail = auditor.get(f"/ui/api/sandboxes/{sbx.id}").json()
    assert detail["revoked"] is False
    with sbx.client() as c:
        assert c.get(sbx.url("api.test", "/v1/x")).status_code == 200
    assert not any(r.get("egressgate.operation") == "revocation" and r.get("egressgate.sandbox.id") == sbx.id
                   for r in gw.audit_records())


def test_operator_revoke_is_audited_and_closes_the_live_connection(gw, operator):
    sbx = gw.admit("gw-basic")
    key = f"ui{time.monotonic_ns()}"
    held = hold_sse(sbx, key, hold=180)  # the upstream holds 180 s; the client never times out
    try:
        assert held.wait_first()
        assert held.thread.is_alive()
        res = operator.delete(f"/ui/api/sandboxes/{sbx.id}")
        assert res.status_code == 200 and res.json()["revoked"] is True, res.text
        assert held.join(60), "the stream outlived the revocation"
        assert "data: last" not in held.outcome.get("lines", []), held.outcome  # cut, not the hold's end
        assert operator.get(f"/ui/api/sandboxes/{sbx.id}").json()["revoked"] is True
        assert wait_for(lambda: any(r.get("egressgate.operation") == "revocation"
                                    and r.get("egressgate.sandbox.id") == sbx.id for r in gw.audit_records()))
    finally:
        gw.world.release_sse(key)


def test_live_feed_delivers_a_proxied_request_within_a_second_and_filters(gw, auditor):
    a, b = gw.admit(METRICS_POLICY, {"team": "a"}), gw.admit(METRICS_POLICY, {"team": "b"})
    everything, only_b = LiveStream(auditor), LiveStream(auditor, sandbox=b.id)
    try:
        assert everything.ready.wait(5) and only_b.ready.wait(5)
        assert everything.status == 200 and everything.headers is not None
        assert everything.headers["content-type"].startswith("text/event-stream")
        assert everything.headers["content-security-policy"] == CSP
        with a.client() as c:
            sent = time.monotonic()
            res = c.get(a.url("api.test", "/echo"), params={"q": "1"})
            request_id = res.headers.get("x-egressgate-request-id") or ""
        assert res.status_code == 200

        def a_record():
            return [(r, t) for r, t in everything.records() if r["sandbox"] == a.id and r["kind"] == "http_request"]
        assert wait_for(a_record, timeout=2)
        record, arrived = a_record()[0]
        assert arrived - sent < 1.0
        assert record["host"] == "api.test" and record["path"] == "/echo" and record["decision"] == "allow"
        assert record["labels"] == {"team": "a"} and record["request_hash"].startswith("sha256:")
        if request_id:
            assert record["request_id"] == request_id
        with b.client() as c:
            assert c.get(b.url("api.test", "/v1/b")).status_code == 200
        assert wait_for(lambda: only_b.records(), timeout=2)
        assert {r["sandbox"] for r, _ in only_b.records()} == {b.id}  # a's records were never queued for it
    finally:
        everything.close()
        only_b.close()


def test_live_feed_rejects_unknown_filters(gw, auditor):
    for query in ("colour=red", "decision=maybe", "host=" + "x" * 300, "sandbox=a&sandbox=b"):
        res = auditor.get(f"/ui/api/live?{query}")
        assert res.status_code == 400 and res.json()["error"] == "invalid_request", query
        assert_secure(res)


def test_index_is_served_to_anyone_but_data_only_with_a_session(gw):
    res = httpx.get(f"http://{gw.admin}/ui/", trust_env=False)
    assert res.status_code == 200 and "<script" in res.text
    body = httpx.get(f"http://{gw.admin}/ui/api/sandboxes", trust_env=False)
    assert body.status_code == 401 and json.loads(body.text)["error"] == "unauthorized"


def test_logout_ends_that_sessions_live_streams_at_once(gw):
    mine, other = ConsoleClient(gw, "auditor"), ConsoleClient(gw, "auditor")
    mine_stream, other_stream = LiveStream(mine), LiveStream(other)
    try:
        assert mine_stream.ready.wait(5) and other_stream.ready.wait(5)
        logged_out = time.monotonic()
        assert mine.post("/ui/api/logout").status_code == 200
        mine_stream._thread.join(3)
        assert not mine_stream._thread.is_alive()  # the stream ended ...
        assert [n for n, _, t in mine_stream.events if n == "logout" and t - logged_out < 1.0]  # ... at once
        assert other_stream._thread.is_alive()  # another session's stream goes on
    finally:
        mine_stream.close()
        other_stream.close()
        mine.close()
        other.close()
