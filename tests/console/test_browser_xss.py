"""Attacker-chosen text reaches the console through real requests (sandbox labels at admission, the Host
header and the path of proxied requests, the approval a request asks for) and must render as text: no
dialog, no element the payload describes, textContent equal to the recorded value. Payloads: `<script>`,
`"onerror=`, an RTL override (U+202E) and 10 kB strings.

Positive control (test_detector_sees_markup_when_parsed): the same detectors fire when a payload IS parsed
as HTML, so their silence on the console means something.
"""

from __future__ import annotations

import json
import socket
import uuid
from typing import Any

from tests.console.conftest import wait_until
from tests.control_api.harness import APPROVE_POLICY, api
from tests.support.gwworld import Gateway, auth
from tests.support.launcher import flatten_otlp

SCRIPT = "<script>alert('xss-script')</script>"
ONERROR = '"onerror=alert(1) x="<img src=x onerror=alert(2)>'
RTL = "invoice\u202Etxt.exe"
BIG = ("<img src=x onerror=alert(3)>" * 400)[:10240]
HOST = '<script>alert("host")</script>"onerror=alert(4) \u202Eevil'
PATH_PAYLOAD = "/" + ("<img/src=x/onerror=alert(5)>" * 400)[:10239]  # no spaces: the request line keeps it
LABELS = {"script": SCRIPT, "onerror": ONERROR, "rtl": RTL, "big": BIG, SCRIPT: "key-is-a-payload"}

# what an injected payload would leave behind: elements the console never creates, handler attributes
INJECTED = """() => ({
  scripts: [...document.scripts].map(s => s.src),
  foreign: document.querySelectorAll(
    'img, iframe, object, embed, frame, base, meta[http-equiv], link:not([rel=stylesheet])').length,
  handlers: [...document.querySelectorAll('*')].flatMap(
    e => [...e.attributes].filter(a => /^on/i.test(a.name)).map(a => e.tagName + ' ' + a.name)),
})"""


def raw_request(gw: Gateway, sbx: Any, target: str, host: str) -> tuple[bytes, str]:
    """One request written byte for byte (httpx would refuse these headers); the reply head and its request id."""
    with socket.create_connection(gw.proxy, timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: ".encode() + host.encode() + b"\r\n" + auth(sbx).encode()
                  + b"Connection: close\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    rid = next((ln.split(":", 1)[1].strip() for ln in head.split("\r\n")
                if ln.lower().startswith("x-egressgate-request-id:")), "")
    return data, rid


def assert_not_injected(c: Any) -> None:
    found = c.page.evaluate(INJECTED)
    assert found["foreign"] == 0, found
    assert found["handlers"] == [], found
    assert len(found["scripts"]) == 1 and found["scripts"][0].endswith("/ui/static/app.js"), found
    c.assert_clean()


def label_values(row: Any) -> dict[str, str]:
    keys = row.locator("[data-field=label-key]").all_text_contents()
    values = row.locator("[data-field=label-value]").all_text_contents()
    return dict(zip(keys, values, strict=True))


def test_payloads_from_real_requests_render_as_text(console, ui_gw: Gateway) -> None:
    w = ui_gw.world
    c = console("operator")
    c.go("live")
    c.page.locator("#live-status:text-is('live')").wait_for()
    sbx = ui_gw.admit("gw-basic", LABELS)
    hp = f"api.test:{w.http_port}"
    reply, host_rid = raw_request(ui_gw, sbx, f"http://{hp}/x", HOST)
    assert reply.startswith(b"HTTP/1.1 421"), reply[:200]  # the Host names another host: denied, recorded
    tag = uuid.uuid4().hex[:6]
    reply, path_rid = raw_request(ui_gw, sbx, f"http://{hp}/{tag}{PATH_PAYLOAD}", hp)
    assert path_rid, reply[:300]

    recorded = {r["egressgate.request.id"]: r for r in ui_gw.audit_records()
                if r.get("egressgate.operation") == "http_request" and r.get("egressgate.request.id") in
                (host_rid, path_rid)}
    assert recorded[host_rid]["egressgate.target.as_sent"] == f"GET {HOST}/x"  # the payload is in the record
    recorded_path = recorded[path_rid]["url.path"]
    assert len(recorded_path) > 10_000 and "img" in recorded_path

    # Live: both requests, labels and the 10 kB path exactly as recorded, as text
    rows = c.page.locator("#live-rows tr", has=c.page.locator(f"[data-field=sandbox]:text-is('{sbx.id}')"))
    wait_until(lambda: rows.count() >= 2, 5, "the two requests in Live")
    labelled = [label_values(row) for row in rows.all() if row.locator("[data-field=label-key]").count()]
    assert len(labelled) >= 2 and all(v == LABELS for v in labelled), labelled  # outcome rows carry none
    # the RTL override is kept (textContent above) but named next to the value it reorders
    labelled_row = rows.filter(has=c.page.locator("[data-field=label-key]")).first
    flags = labelled_row.locator("[data-field=hidden-chars]").all_text_contents()
    assert "⚠ U+202E" in flags, flags
    path_row = c.page.locator(f"#live-rows tr[data-id='{path_rid}']:has(.v[data-field=path])").first
    assert path_row.locator("[data-field=path]").text_content() == recorded_path
    assert_not_injected(c)

    # Sandboxes: the detail page shows the labels as text
    c.go("sandboxes")
    c.page.locator(f"#sandbox-list tr[data-id='{sbx.id}'] [data-testid=open-sandbox]").click()
    detail = c.page.locator("#sandbox-detail")
    detail.locator("h2", has_text=sbx.id).wait_for()
    assert label_values(detail.locator("dd [data-field=labels]")) == LABELS
    assert_not_injected(c)

    # Audit search: the record read back from the JSONL, Host payload included, as text
    c.go("search")
    c.page.fill("#search-form [name=request_id]", host_rid)
    hits = c.page.locator("#search-results [data-testid=hit]")

    def found() -> bool:
        c.submit("#search", "#search-count")
        return hits.count() > 0
    wait_until(found, 10, "the Host-payload record in the index", interval=0.2)
    shown = [flatten_otlp(json.loads(h.locator("[data-field=record]").text_content())) for h in hits.all()]
    assert f"GET {HOST}/x" in [s.get("egressgate.target.as_sent") for s in shown], shown
    assert_not_injected(c)

    # Overview: reason codes and host names drawn into the SVG as text
    c.go("overview")

    def drawn() -> bool:
        c.page.click("#overview-refresh")
        c.page.locator("#overview-charts figure, #overview-charts .notice.error").first.wait_for()
        return "host_mismatch" in c.page.locator("#overview-charts [data-field=reason]").all_text_contents()
    wait_until(drawn, 10, "the host_mismatch denies in the chart", interval=0.2)
    assert_not_injected(c)


def test_detector_sees_markup_when_parsed(browser) -> None:
    """Positive control: parsed as HTML (innerHTML, no CSP), the payloads do fire a dialog and do leave
    elements and handler attributes behind: the detectors above would see a console that did this."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_content("<div id=x></div><script src=/nothing.js></script>")
        with page.expect_event("dialog", timeout=5000) as fired:
            page.evaluate("p => { document.getElementById('x').innerHTML = p; }", ONERROR + BIG[:60])
        fired.value.dismiss()
        found = page.evaluate(INJECTED)
        assert found["foreign"] >= 1 and found["handlers"], found
        # and textContent then no longer equals the payload (markup was consumed)
        assert page.evaluate("() => document.getElementById('x').textContent") != ONERROR + BIG[:60]
    finally:
        context.close()


def test_approval_request_payloads_render_as_text(console, ui_gw: Gateway) -> None:
    """An approval is asked for by the sandbox's own request: its host, path and labels reach the queue."""
    port = ui_gw.world.http_port
    sbx = ui_gw.admit(APPROVE_POLICY, {"team": SCRIPT, "rtl": RTL})
    reply, _ = raw_request(ui_gw, sbx, f"http://other.test:{port}{PATH_PAYLOAD}", f"other.test:{port}")
    assert reply.startswith(b"HTTP/1.1 403"), reply[:200]
    asked = wait_until(lambda: [a for a in api(ui_gw, "GET", "/v1/approvals?state=pending").json()["approvals"]
                                if a["sandbox_id"] == sbx.id], 5, "the pending approval")[0]
    assert "img" in (asked["path"] or ""), asked  # the payload is in what the queue will show
    c = console("operator")
    c.go("approvals")
    row = c.page.locator(f"#approvals-list tr[data-id='{asked['id']}']")
    row.wait_for()
    assert row.locator("[data-field=path]").text_content() == asked["path"]
    assert row.locator("[data-field=host]").text_content() == asked["host"]
    assert_not_injected(c)
