"""The console in a real browser (Debian chromium via Playwright) against a real gateway with real
traffic through its proxy: per-role login, the live feed, revoke, audit search, replay-diff, approvals,
the calculators. One gateway and one browser shared with test_browser_xss.py (conftest.py).
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

import httpx
import yaml

from egressgate.audit.reqhash import request_hash_raw
from tests.console.conftest import wait_until
from tests.control_api.harness import APPROVE_POLICY, METRICS_POLICY, api
from tests.support.gwworld import Gateway, connect_tunnel
from tests.support.launcher import flatten_otlp


def by_request_id(gw: Gateway, request_id: str, operation: str = "http_request") -> dict:
    """The gateway's own audit record (from the JSONL file) of one request."""
    def find() -> dict | None:
        for rec in gw.audit_records():
            if rec.get("egressgate.request.id") == request_id and rec.get("egressgate.operation") == operation:
                return rec
        return None
    return wait_until(find, 5, f"the audit record of {request_id}")


def test_login_per_role(console, ui_gw: Gateway) -> None:
    anon = console(None)
    anon.page.fill("#login-form input[name=token]", "not-a-token")
    anon.page.click("#login-submit")
    anon.page.locator("#login-form .notice.error").wait_for()
    assert anon.page.locator("#nav").is_hidden()  # still signed out
    # the admin bearer token is not a console token either
    anon.page.fill("#login-form input[name=token]", ui_gw.token)
    anon.page.click("#login-submit")
    anon.page.locator("#login-form .notice.error").wait_for()
    assert anon.page.locator("#nav").is_hidden()

    op = console("operator")
    assert op.page.locator("[data-testid=role]").text_content() == "operator"
    assert op.page.locator("#nav").is_visible()
    op.page.reload()  # the session cookie survives a reload; the page asks /ui/api/session
    op.page.locator("[data-testid=role]:text-is('operator')").wait_for()
    op.page.click("#logout")
    op.page.locator("#login-form").wait_for()
    op.page.reload()
    op.page.locator("#login-form").wait_for()  # logout deleted the session server-side
    op.assert_clean()

    aud = console("auditor")
    assert aud.page.locator("[data-testid=role]").text_content() == "auditor"
    aud.context.clear_cookies()  # a session that ends under the page: the next call brings the login form
    aud.page.evaluate("() => { location.hash = '#/sandboxes'; }")
    aud.page.locator("#login-form .notice.error", has_text="session ended").wait_for()
    aud.assert_clean()
    anon.assert_clean()


def test_logout_in_another_tab_ends_the_live_feed(console, ui_gw: Gateway) -> None:
    c = console("operator")
    c.go("live")
    c.page.locator("#live-status:text-is('live')").wait_for()
    other = c.context.new_page()  # same browser context: the same session cookie
    other.goto(f"{c.base}/ui/")
    other.locator("[data-testid=role]:text-is('operator')").wait_for()
    other.click("#logout")
    other.locator("#login-form").wait_for()
    c.page.locator("#login-form .notice.error", has_text="session ended").wait_for()
    c.assert_clean()


def test_proxied_request_appears_in_live_within_1s(console, ui_gw: Gateway) -> None:
    c = console("operator")
    c.go("live")
    c.page.locator("#live-status:text-is('live')").wait_for()
    sbx = ui_gw.admit(METRICS_POLICY, {"team": "live"})
    path = f"/v1/live-{uuid.uuid4().hex[:8]}"
    row = c.page.locator("#live-rows tr", has=c.page.locator(f"[data-field=path]:text-is('{path}')"))
    with sbx.client() as client:
        start = time.monotonic()
        res = client.get(sbx.url("api.test", path))
        row.first.wait_for(timeout=5000)
        elapsed = time.monotonic() - start
    assert res.status_code == 200, res.text
    assert elapsed < 1.0, f"the request showed up in Live after {elapsed:.2f} s"
    first = row.first
    assert first.locator("[data-field=sandbox]").text_content() == sbx.id
    assert first.locator("[data-field=host]").text_content() == "api.test"
    assert first.locator("[data-field=decision]").text_content() == "allow"
    assert first.get_attribute("data-id") == res.headers["x-egressgate-request-id"]

    # the server-side filter: a denied request of another sandbox does not show under sandbox=<sbx>
    c.page.fill("#live-filters input[name=sandbox]", sbx.id)
    c.page.click("#live-filters button[type=submit]")
    c.page.locator("#live-status:text-is('live')").wait_for()
    other = ui_gw.admit(METRICS_POLICY, {"team": "other"})
    with other.client() as oc, sbx.client() as client:
        assert oc.get(other.url("api.test", "/nope")).status_code == 403
        denied = client.get(sbx.url("api.test", "/nope-mine"))
    assert denied.status_code == 403
    mine = c.page.locator("#live-rows tr", has=c.page.locator("[data-field=path]:text-is('/nope-mine')"))
    mine.first.wait_for(timeout=5000)
    assert mine.first.locator("[data-field=reason]").text_content() == denied.json()["reason"]
    assert c.page.locator("#live-rows [data-field=sandbox]", has_text=other.id).count() == 0

    # a row's request hash opens Audit search for it
    link = mine.first.locator("[data-field=request_hash]")
    req_hash = link.text_content()
    assert req_hash.startswith("sha256:")
    link.click()
    c.page.locator("[data-testid=page-search]").wait_for()
    assert c.page.locator("#search-form [name=request_hash]").input_value() == req_hash
    hits = c.page.locator("#search-results [data-testid=hit]")

    def found() -> bool:  # searched on arrival; the index may be a moment behind: search again
        if hits.count():
            return True
        c.submit("#search", "#search-count")
        return hits.count() > 0
    wait_until(found, 10, "the record found from the Live row", interval=0.2)
    assert c.page.locator("#search-results dd [data-field=attr]", has_text=req_hash).count() >= 1
    c.assert_clean()


def open_tunnel(gw: Gateway, sbx) -> socket.socket:
    sock, head = connect_tunnel(gw, sbx, f"api.test:{gw.world.https_port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def still_open(sock: socket.socket) -> bool:
    sock.settimeout(0.3)
    try:
        return sock.recv(1) != b""  # a byte would be a protocol error; b"" is "closed"
    except TimeoutError:
        return True
    except OSError:
        return False


def closed_within(sock: socket.socket, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not still_open(sock):
            return True
    return False


def show_sandbox(c, sandbox_id: str) -> None:
    c.go("sandboxes")
    c.page.locator(f"#sandbox-list tr[data-id='{sandbox_id}'] [data-testid=open-sandbox]").click()
    c.page.locator("#sandbox-detail h2", has_text=sandbox_id).wait_for()


def test_auditor_cannot_revoke(console, ui_gw: Gateway) -> None:
    sbx = ui_gw.admit(METRICS_POLICY, {"team": "audited"})
    sock = open_tunnel(ui_gw, sbx)
    try:
        c = console("auditor")
        show_sandbox(c, sbx.id)
        wait_until(lambda: c.page.locator("[data-testid=connections]").text_content() == "1", 5,
                   "the open tunnel in the sandbox's live connections")
        assert c.page.locator("#revoke").count() == 0  # not rendered for an auditor
        assert c.page.locator("[data-testid=budget-table]").count() == 1  # but the page itself did render
        res = c.fetch("DELETE", f"/ui/api/sandboxes/{sbx.id}")
        assert res["status"] == 403, res
        assert json.loads(res["body"])["error"] == "forbidden"
        assert api(ui_gw, "GET", f"/v1/sandboxes/{sbx.id}").json()["revoked"] is False
        assert still_open(sock)
        c.assert_clean()
    finally:
        sock.close()


def test_operator_revoke_closes_open_connection(console, ui_gw: Gateway) -> None:
    sbx = ui_gw.admit(METRICS_POLICY, {"team": "revoked"})
    sock = open_tunnel(ui_gw, sbx)
    try:
        c = console("operator")
        show_sandbox(c, sbx.id)
        wait_until(lambda: c.page.locator("[data-testid=connections]").text_content() == "1", 5,
                   "the open tunnel in the sandbox's live connections")
        assert still_open(sock)  # positive control: the tunnel is up until the operator acts
        c.page.click("#revoke")
        c.page.click("#revoke-confirm")
        c.page.locator("#sandbox-detail [data-field=state]", has_text="revoked").wait_for()
        assert closed_within(sock, 5), "revoking from the console left the sandbox's tunnel open"
        assert api(ui_gw, "GET", f"/v1/sandboxes/{sbx.id}").json()["revoked"] is True
        assert c.page.locator("#revoke").count() == 0
        with sbx.client() as client:  # and it cannot open a new one
            try:
                refused = client.get(sbx.url("api.test", "/echo")).status_code
            except httpx.ProxyError:
                refused = 407
        assert refused in (403, 407)
        c.assert_clean()
    finally:
        sock.close()


def search(c, **fields: str) -> None:
    c.go("search")
    for name, value in fields.items():
        c.page.fill(f"#search-form [name={name}]", value)


def test_search_by_request_hash_finds_the_record(console, ui_gw: Gateway) -> None:
    sbx = ui_gw.admit(METRICS_POLICY, {"team": "search"})
    with sbx.client() as client:
        res = client.get(sbx.url("api.test", f"/v1/search-{uuid.uuid4().hex[:8]}"))
    assert res.status_code == 200
    rec = by_request_id(ui_gw, res.headers["x-egressgate-request-id"])
    req_hash = rec["egressgate.request.hash"]
    c = console("auditor")
    search(c, request_hash=req_hash)
    hits = c.page.locator("#search-results [data-testid=hit]")

    def found() -> bool:  # the index follows the file every 0.5 s: search again until it has it
        c.submit("#search", "#search-count")
        return hits.count() > 0
    wait_until(found, 10, "the record in the index", interval=0.2)
    shown = []  # (the record as the page shows it, flattened; the chain position the page shows next to it)
    for h in hits.all():
        shown.append((flatten_otlp(json.loads(h.locator("[data-field=record]").text_content())),
                      h.locator("[data-field=chain_index]").text_content(),
                      h.locator("[data-field=verified]").text_content()))
    assert all(attrs["egressgate.request.hash"] == req_hash for attrs, _, _ in shown), shown
    assert all(pos == str(attrs["egressgate.chain.seq"]) for attrs, pos, _ in shown), shown
    assert all(v == "chain verified" for _, _, v in shown), shown
    mine = [attrs for attrs, _, _ in shown if attrs["egressgate.request.id"] == rec["egressgate.request.id"]
            and attrs["egressgate.operation"] == "http_request"]
    assert mine == [rec], shown  # the very record the gateway wrote, read back from its file

    search(c, request_hash="sha256:" + "0" * 64)  # negative control: another hash finds nothing
    c.submit("#search", "#search-count")
    assert c.page.locator("#search-count").text_content() == "0 records"

    # the time range (UTC, minutes): around the request finds it, the hour after it does not
    def minute(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M", time.gmtime(t))
    now = time.time()
    for since, until, expect in ((now - 120, now + 120, True), (now + 3600, now + 7200, False)):
        search(c, request_hash=req_hash, since=minute(since), until=minute(until))
        c.submit("#search", "#search-count")
        assert (hits.count() > 0) is expect, (since, until)
    c.assert_clean()


def test_replay_diff_shows_flipped_decisions(console, ui_gw: Gateway) -> None:
    w = ui_gw.world
    sbx = ui_gw.admit("gw-basic", {"team": "replay"})
    with sbx.client() as client:
        allowed = client.get(sbx.url("api.test", "/echo", scheme="http"))
        denied = client.get(sbx.url("other.test", "/echo", scheme="http"))
    assert allowed.status_code == 200 and denied.status_code == 403
    # the candidate turns both around: only other.test over plain http
    candidate = yaml.safe_dump({"sandbox": {"name": "gw-basic"}, "network": {
        "allow_private": ["127.0.0.1/32"],
        "http": {"allow": [{"id": "cand-other", "host": "other.test", "ports": [w.http_port]}]}}})
    c = console("auditor")
    c.go("replay")
    c.page.fill("#replay-form [name=policy_yaml]", candidate)
    c.page.fill("#replay-form [name=sandbox]", sbx.id)

    rows = c.page.locator("[data-testid=flips-table] tr.flip")

    def flipped() -> dict[str, str]:
        c.submit("#replay", "#flip-count")
        return {r.locator("[data-field=target]").text_content(): r.locator("[data-field=direction]").text_content()
                for r in rows.all()}
    flips = wait_until(flipped, 10, "the flips in the replay diff", interval=0.2)
    by_host = {t.split("//")[-1].split("/")[0].split(":")[0]: d for t, d in flips.items()}
    assert by_host == {"api.test": "allow->deny", "other.test": "deny->allow"}, flips
    assert rows.count() == 2 and all(sbx.id == r.locator("[data-field=sandbox]").text_content() for r in rows.all())
    c.assert_clean()


def test_approvals_queue(console, ui_gw: Gateway) -> None:
    op = console("operator")
    op.go("approvals")  # open before the request: the queue shows it by itself
    op.page.locator("#approvals-list table, #approvals-list .notice").first.wait_for()
    sbx = ui_gw.admit(APPROVE_POLICY, {"team": "approve"})
    with sbx.client() as client:
        asked = client.get(sbx.url("other.test", "/echo", scheme="http"))
    assert asked.status_code == 403, asked.text
    pending = wait_until(lambda: [a for a in api(ui_gw, "GET", "/v1/approvals?state=pending").json()["approvals"]
                                  if a["sandbox_id"] == sbx.id], 5, "the pending approval")
    approval_id = pending[0]["id"]
    aud = console("auditor")
    aud.go("approvals")
    row = aud.page.locator(f"#approvals-list tr[data-id='{approval_id}']")
    row.wait_for()
    assert row.locator("button").count() == 0  # an auditor sees the queue, no Approve/Deny
    res = aud.fetch("POST", f"/ui/api/approvals/{approval_id}/approve", {})
    assert res["status"] == 403, res

    row = op.page.locator(f"#approvals-list tr[data-id='{approval_id}']")
    row.wait_for(timeout=8000)  # polled every 3 s, no click on Refresh
    assert row.locator("[data-field=host]").text_content() == "other.test"
    row.locator("button.approve").click()
    wait_until(lambda: api(ui_gw, "GET", f"/v1/approvals/{approval_id}").json()["state"] == "approved", 5,
               "the approval to be granted")
    assert api(ui_gw, "GET", f"/v1/approvals/{approval_id}").json()["decided_by"] == "console:operator"
    with sbx.client() as client:
        assert client.get(sbx.url("other.test", "/echo", scheme="http")).status_code == 200
    aud.assert_clean()
    op.assert_clean()


def test_request_hash_calculator_and_explain(console, ui_gw: Gateway) -> None:
    c = console("auditor")
    c.go("hash")
    url = f"https://api.test:{ui_gw.world.https_port}/v1/x?b=2&a=1"
    c.page.fill("#hash-form [name=method]", "POST")
    c.page.fill("#hash-form [name=url]", url)
    c.page.fill("#hash-form [name=headers]", "Content-Type: application/json\nX-Thing: 1")
    c.page.fill("#hash-form [name=body]", '{"k": "é"}')
    c.page.click("#hash-submit")
    shown = c.page.locator("#hash-result [data-field=request_hash]")
    shown.wait_for()
    expected = request_hash_raw("POST", url, [("Content-Type", "application/json"), ("X-Thing", "1")],
                                '{"k": "é"}'.encode())
    assert shown.text_content() == expected

    c.go("explain")
    c.page.fill("#explain-form [name=policy]", METRICS_POLICY)
    c.page.fill("#explain-form [name=url]", f"https://api.test:{ui_gw.world.https_port}/echo")
    c.page.click("#explain-submit")
    c.page.locator("#explain-result [data-field=decision]", has_text="allow").wait_for()
    assert c.page.locator("#explain-result [data-field=rule]").text_content() == "c12-get"
    c.page.fill("#explain-form [name=url]", f"https://api.test:{ui_gw.world.https_port}/nope")
    c.page.click("#explain-submit")
    c.page.locator("#explain-result [data-field=decision]", has_text="deny").wait_for()
    assert c.page.locator("#explain-result [data-field=message]").text_content()
    c.assert_clean()


def test_overview_charts_denies(console, ui_gw: Gateway) -> None:
    sbx = ui_gw.admit(METRICS_POLICY, {"team": "overview"})
    host = "other.test"
    with sbx.client() as client:  # c12-cred allows other.test only for GET: a POST is denied
        for _ in range(3):
            assert client.post(sbx.url(host, "/echo"), content=b"x").status_code == 403
    c = console("auditor")
    c.go("overview")

    def drawn() -> bool:
        c.page.click("#overview-refresh")
        c.page.locator("#overview-charts figure, #overview-charts .notice.error").first.wait_for()
        return host in c.page.locator("[data-testid=hosts-chart] [data-field=host]").all_text_contents()
    wait_until(drawn, 10, "the denied host in the top denied hosts", interval=0.2)
    assert c.page.locator("[data-testid=denies-chart] rect[data-field=bar]").count() >= 1
    assert c.page.locator("#overview-charts [data-field=reason]").count() >= 1
    c.assert_clean()


# denied by policy before any resolution (never contacted), and a name the learner may propose (.test is a
# special-use name it never proposes)
LEARN_HOST = "learn-me.e14f-console.net"


def test_learn_downloads_yaml(console, ui_gw: Gateway) -> None:
    w = ui_gw.world
    sbx = ui_gw.admit("gw-basic", {"team": "learn"})
    with sbx.client() as client:
        assert client.get(sbx.url(LEARN_HOST, "/learn/me", scheme="http")).status_code == 403
    c = console("auditor")
    c.go("learn")
    c.page.fill("#learn-form [name=sandbox]", sbx.id)
    c.submit("#learn", "#download-link")
    shown = c.page.locator("#learn-yaml").text_content()
    with c.page.expect_download() as download:
        c.page.click("#download-link")
    saved = download.value
    assert saved.suggested_filename == f"learned-{sbx.id}.yaml"
    text = Path(saved.path()).read_text(encoding="utf-8")
    assert text == shown
    learned = yaml.safe_load(text)
    rules = learned["network"]["http"]["allow"]
    assert [(r["host"], r["ports"]) for r in rules] == [(LEARN_HOST, [w.http_port])], learned
    c.assert_clean()
