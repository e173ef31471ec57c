"""The console as a security team reads it (issue 23 item 14): every page at 1366x768 and 1920x1080 with real
records on it, screenshots kept as artifacts, no page wider than the window, readable units and axes, approval
steps that say what they are, and axe-core (from the npm registry, scripts/install-axe.sh) finding no serious or
critical accessibility violation.

Screenshots go to $EGRESSGATE_TEST_ARTIFACTS/console (default build/test-artifacts/console), one PNG per page
and size: what a reviewer opens to see the console without running it."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.console.conftest import Console, wait_until
from tests.control_api.harness import APPROVE_POLICY, METRICS_POLICY, api
from tests.support.cli import ROOT
from tests.support.env import IN_CI
from tests.support.gwworld import Gateway

AXE_VERSION = "4.10.3"  # scripts/install-axe.sh
AXE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    f"egressgate/npm/axe-core-{AXE_VERSION}/node_modules/axe-core/axe.min.js")
SIZES = {"laptop": (1366, 768), "desktop": (1920, 1080)}
PAGES = ["live", "overview", "sandboxes", "approvals", "search", "hash", "explain", "replay", "learn"]
ARTIFACTS = Path(os.environ.get("EGRESSGATE_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts")) / "console"


@pytest.fixture(scope="module")
def traffic(ui_gw: Gateway) -> dict[str, Any]:
    """Records on every page: allowed and denied requests with labels, a budgeted sandbox that moved bytes, and
    an approval that is pending (its `requested` record has no allow/deny)."""
    sbx = ui_gw.admit(METRICS_POLICY, {"team": "layout", "run": uuid.uuid4().hex[:6]})
    with sbx.client() as client:
        assert client.post(sbx.url("api.test", "/upload"), content=b"x" * 300_000).status_code < 400
        assert client.get(sbx.url("api.test", "/nope-layout")).status_code == 403
    asker = ui_gw.admit(APPROVE_POLICY, {"team": "layout"})
    with asker.client() as client:
        assert client.get(asker.url("other.test", "/echo", scheme="http")).status_code == 403
    wait_until(lambda: [a for a in api(ui_gw, "GET", "/v1/approvals?state=pending").json()["approvals"]
                        if a["sandbox_id"] == asker.id], 10, "the pending approval")
    # a persistent write waiting for an operator (what `sandbox run` stages: runtimes/persist.py)
    write = api(ui_gw, "POST", "/v1/workspaces/writes", json={
        "sandbox_id": asker.id, "workspace": f"layout-{uuid.uuid4().hex[:6]}", "changes": WRITE_CHANGES,
        "manifest_hash": "sha256:" + "ab" * 32, "base_manifest_hash": "none"})
    assert write.status_code == 201, write.text
    return {"sandbox": sbx, "asker": asker, "write": write.json()["id"]}


WRITE_CHANGES = [
    {"path": "reports/q3.csv", "action": "added", "type": "f", "size": 10_485_760, "sha256": "c0ffee" * 10 + "abcd"},
    {"path": "src/" + "deeply/" * 12 + "nested.py", "action": "changed", "type": "f", "size": 812,
     "sha256": "beef" * 16},
    {"path": "old/notes.txt", "action": "removed", "type": "f", "size": None, "sha256": None},
]


def _open_write(c: Console, approval_id: str):
    """The persistent write's row on the approvals page, its change list unfolded."""
    c.page.select_option("#approvals-state", "pending")
    row = c.page.locator(f"#approvals-list tr[data-id='{approval_id}']")
    row.wait_for()
    row.locator("[data-testid=write-changes] summary").click()
    row.locator("[data-testid=write-changes-table]").wait_for()
    return row


def _page_fits(c: Console) -> tuple[int, int]:
    """(document width, window width): a page wider than the window scrolls sideways (the live table used to)."""
    return c.page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")


def _settle(c: Console, name: str) -> None:
    if name == "live":
        c.page.locator("#live-status:text-is('live')").wait_for()
    elif name == "overview":
        c.page.locator("[data-testid=denies-chart], #overview-charts .notice").first.wait_for()
    elif name == "sandboxes":
        c.page.locator("[data-testid=sandbox-table]").wait_for()
    elif name == "approvals":
        c.page.locator("#approvals-list table, #approvals-list .notice").first.wait_for()


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_page_fits_the_screen_and_is_captured(console, traffic, size: str) -> None:
    c = console("operator")
    c.page.set_viewport_size(dict(zip(("width", "height"), SIZES[size], strict=True)))
    out = ARTIFACTS / size
    out.mkdir(parents=True, exist_ok=True)
    for name in PAGES:
        c.go(name)
        _settle(c, name)
        if name == "live":  # rows arrive while the page is open: make two
            sbx = traffic["sandbox"]
            with sbx.client() as client:
                client.get(sbx.url("api.test", f"/v1/{'w' * 60}-{uuid.uuid4().hex}"))
                client.get(sbx.url("api.test", "/nope-live"))
            c.page.locator("#live-rows tr").nth(1).wait_for()
        if name == "sandboxes":
            c.page.locator(f"#sandbox-list tr[data-id='{traffic['sandbox'].id}'] [data-testid=open-sandbox]").click()
            c.page.locator("[data-testid=budget-table]").wait_for()
        if name == "approvals":  # a persistent write's change list unfolded: it must fit too
            _open_write(c, traffic["write"])
        c.page.screenshot(path=str(out / f"{name}.png"), full_page=True)
        width, window = _page_fits(c)
        assert width <= window, f"{name} at {size}: {width} px wide in a {window} px window"
    assert sorted(p.name for p in out.glob("*.png")) == sorted(f"{n}.png" for n in PAGES)
    c.assert_clean()


def test_units_axes_and_approval_steps_are_readable(console, traffic) -> None:
    c = console("operator")
    # sandboxes: bytes in KiB/MiB (the exact count in the title), times as UTC, never a raw epoch
    c.go("sandboxes")
    c.page.locator(f"#sandbox-list tr[data-id='{traffic['sandbox'].id}'] [data-testid=open-sandbox]").click()
    budget = c.page.locator("[data-testid=budget-table] tr", has_text="outbound bytes")
    budget.wait_for()
    cells = budget.locator("[data-field=bytes]").all_text_contents()
    assert cells and all(t.endswith(("KiB", "MiB", " B")) for t in cells), cells
    limit = budget.locator("[data-field=bytes]").nth(1)  # Used, Limit, Left
    assert limit.text_content() == "977 KiB" and limit.get_attribute("title") == "1,000,000 bytes"  # the policy's
    admitted = c.page.locator("#sandbox-detail [data-field=admitted_at]").text_content()
    assert admitted.endswith(" UTC") and admitted[:4].isdigit() and "." not in admitted, admitted
    # overview: y ticks from 0 to a round maximum, both axes titled
    c.go("overview")
    chart = c.page.locator("[data-testid=denies-chart]")
    chart.wait_for()
    ticks = [float(t) for t in chart.locator("[data-field=y-tick]").all_text_contents()]
    assert ticks[0] == 0 and len(ticks) == 3 and ticks[2] == 2 * ticks[1], ticks
    assert chart.locator("[data-field=y-title]").text_content().startswith("denies per ")
    assert chart.locator("[data-field=x-title]").text_content() == "time (UTC)"
    assert chart.locator("[data-field=x-tick]").count() == 3
    # audit search: one summary line per hit, its attributes folded (was a 30-row list per hit)
    c.go("search")
    c.page.fill("#search-form [name=sandbox]", traffic["sandbox"].id)
    hits = c.page.locator("#search-results [data-testid=hit]")

    def found() -> bool:
        c.submit("#search", "#search-count")
        return hits.count() > 0
    wait_until(found, 15, "the sandbox's records in the index", interval=0.3)
    first = hits.first
    assert first.locator("details.attrs").get_attribute("open") is None  # folded
    assert first.locator("details.attrs dd").first.is_hidden()
    assert first.locator("header [data-field=decision]").text_content() in ("allow", "deny", "no decision")
    summary_height = first.locator("header").bounding_box()["height"]
    assert summary_height < 80, summary_height  # two lines, not a page
    # live: an approval's `requested` step says so instead of "—"
    c.go("live")
    c.page.locator("#live-status:text-is('live')").wait_for()
    asker = c.gw.admit(APPROVE_POLICY, {"team": "layout-live"})  # a new sandbox: a new approval, a new record
    with asker.client() as client:
        assert client.get(asker.url("other.test", "/echo", scheme="http")).status_code == 403
    row = c.page.locator("#live-rows tr", has=c.page.locator(f"[data-field=sandbox]:text-is('{asker.id}')")).filter(
        has=c.page.locator("[data-field=kind]:text-is('approval')")).first
    row.wait_for()
    assert row.locator("[data-field=decision]").text_content() == "requested"
    assert c.page.locator("#live-rows [data-field=decision]:text-is('—')").count() == 0
    c.assert_clean()


def test_a_persistent_write_shows_its_change_list(console, traffic) -> None:
    """A persistent write is one compact row (workspace, how many changes) whose change list unfolds: every path
    with its change, size and hash (it was a generic row "write workspace:<name>", the paths nowhere)."""
    c = console("auditor")  # reading it needs no operator role
    c.go("approvals")
    _settle(c, "approvals")
    c.page.select_option("#approvals-state", "pending")
    row = c.page.locator(f"#approvals-list tr[data-id='{traffic['write']}']")
    row.wait_for()
    box = row.locator("[data-testid=write-changes]")
    assert box.get_attribute("open") is None  # folded: the row stays one line
    summary = box.locator("summary").text_content()
    assert summary.startswith("write layout-") and summary.endswith(" · 3 changes"), summary
    row = _open_write(c, traffic["write"])
    table = row.locator("[data-testid=write-changes-table]")
    assert table.locator("[data-field=path]").all_text_contents() == [ch["path"] for ch in WRITE_CHANGES]
    assert table.locator("[data-field=action]").all_text_contents() == ["added", "changed", "removed"]
    assert table.locator("[data-field=size]").first.text_content() == "10.0 MiB"
    assert table.locator("[data-field=sha256]").first.text_content() == WRITE_CHANGES[0]["sha256"]  # whole, cut by CSS
    # control: a network approval's row is the request itself, nothing to unfold
    other = c.page.locator("#approvals-list tr", has=c.page.locator(
        f"[data-field=sandbox_id]:text-is('{traffic['asker'].id}')")).filter(has=c.page.locator("[data-field=host]"))
    assert other.first.locator("[data-field=host]").text_content() == "other.test"
    assert other.first.locator("[data-testid=write-changes]").count() == 0
    c.assert_clean()


def test_no_serious_accessibility_violation_on_any_page(browser, ui_gw: Gateway, traffic) -> None:
    if not AXE.exists():
        if IN_CI:
            pytest.fail(f"{AXE} is missing: scripts/install-axe.sh (make test-deps) fetches it")
        pytest.skip(f"{AXE} is missing (scripts/install-axe.sh)")
    c = Console(browser, ui_gw, bypass_csp=True)  # axe is injected as a script: the console's CSP would refuse it
    try:
        c.login("operator")
        c.page.set_viewport_size({"width": 1366, "height": 768})
        found: dict[str, list[str]] = {}
        for name in PAGES:
            c.go(name)
            _settle(c, name)
            if name == "approvals":
                _open_write(c, traffic["write"])
            found[name] = _axe(c)
        c.page.click("#logout")
        c.page.locator("#login-form").wait_for()
        found["login"] = _axe(c)
        assert {k: v for k, v in found.items() if v} == {}, found
        # positive control: the same check flags a serious violation when one is there
        c.page.evaluate("() => { const i = document.createElement('input'); i.type = 'text';"
                        " document.querySelector('#login-form').append(i); }")
        assert any(v.startswith("label") for v in _axe(c)), "axe did not flag an unlabelled input"
    finally:
        c.close()


def _axe(c: Console) -> list[str]:
    """The serious and critical violations of the page as "rule: target, ..."."""
    if not c.page.evaluate("() => typeof window.axe !== 'undefined'"):
        c.page.add_script_tag(path=str(AXE))
    result = c.page.evaluate("""async () => {
        const r = await axe.run(document, {resultTypes: ['violations']});
        return r.violations.filter(v => v.impact === 'serious' || v.impact === 'critical')
          .map(v => v.id + ': ' + v.nodes.slice(0, 3).map(n => n.target.join(' ')).join(', '));
      }""")
    return list(result)
