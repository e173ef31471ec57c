"""Browser fixtures of the console tests: one real gateway (`egressgate run` on loopback, real upstreams:
tests/control_api/harness.py) and one headless Debian chromium (Playwright, executable_path: no browser
download), shared by the browser test modules of this package (each test admits its own sandboxes); a
fresh browser context per console session, so cookies never leak between roles.

The chromium is Debian's `chromium-headless-shell`: the same build (Blink, V8, network stack, CSP) as
/usr/bin/chromium without the desktop browser around it — what Playwright itself runs for headless Chromium.
The full browser in `--headless` mode burnt ~1.7 CPU-s per logged-in browser context on the 2-core test
machine, the shell ~0.5 (and ~0.6 instead of ~0.9 per launch): the console modules were ~60 CPU-s of
`make test`. EGRESSGATE_TEST_CHROMIUM=/usr/bin/chromium runs them in the full browser instead.

`Console` wraps one page: it records every dialog (an XSS payload that ran would open one), every page
error and every console error (a CSP violation is reported there), and logs in with a role's token read
from the gateway's var dir, as an operator would paste it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.control_api.harness import start_control_gateway
from tests.support.env import IN_CI
from tests.support.gwworld import Gateway, World, open_world
from tests.support.launcher import stop_gateway
from tests.support.replay_check import assert_config_replays

CHROMIUM = os.environ.get("EGRESSGATE_TEST_CHROMIUM", "/usr/bin/chromium-headless-shell")


def role_token(gw: Gateway, role: str) -> str:
    """The console token of `role`: a 0600 file next to the admin token (created on first start)."""
    return (gw.var / f"console-{role}.token").read_text().strip()


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `check` until it returns something truthy (no fixed sleeps); fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class Console:
    """One browser context + page on the console of `gw`."""

    def __init__(self, browser: Any, gw: Gateway, bypass_csp: bool = False) -> None:
        self.gw = gw
        self.base = f"http://{gw.admin}"
        self.context = browser.new_context(bypass_csp=bypass_csp)  # only to inject a checker (axe-core)
        self.page = self.context.new_page()
        self.page.set_default_timeout(10_000)
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.csp: list[str] = []
        self.page.on("dialog", self._dialog)
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("console", self._console)

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def _console(self, msg: Any) -> None:
        # an HTTP error status the page handles (401 before login, a 403 it shows) is not a script error
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            text = msg.text
            (self.csp if "Content Security Policy" in text else self.errors).append(text)

    def open(self) -> Console:
        self.page.goto(f"{self.base}/ui/")
        return self

    def login(self, role: str) -> Console:
        self.open()
        self.page.fill("#login-form input[name=token]", role_token(self.gw, role))
        self.page.click("#login-submit")
        self.page.locator(f"[data-testid=role]:text-is('{role}')").wait_for()
        return self

    def go(self, name: str) -> Any:
        """Open a page of the console by its hash route; returns its root locator."""
        self.page.evaluate("n => { location.hash = '#/' + n; }", name)
        root = self.page.locator(f"[data-testid=page-{name}]")
        root.wait_for()
        return root

    def fetch(self, method: str, path: str, body: Any = None, csrf: bool = True) -> dict:
        """A request from inside the page (same origin, the session cookie), as a tampered client would
        send it: the CSRF token from /ui/api/session. Returns {"status", "body"}."""
        return self.page.evaluate(
            """async ([method, path, body, csrf]) => {
                 const s = await (await fetch('/ui/api/session')).json();
                 const headers = {'Content-Type': 'application/json'};
                 if (csrf) headers['X-CSRF-Token'] = s.csrf;
                 const res = await fetch(path, {method, headers,
                   body: body === null ? undefined : JSON.stringify(body)});
                 return {status: res.status, body: await res.text()};
               }""", [method, path, body, csrf])

    def submit(self, form: str, done: str) -> None:
        """Submit `form` (its #<form>-submit button) and wait for `done` or the error notice the page shows
        instead; an error fails the test at once with the server's message."""
        self.page.click(f"{form}-submit")
        result = self.page.locator(f"{done}, {form}-result .notice.error, #search-results .notice.error")
        result.first.wait_for()
        err = self.page.locator(f"{form}-result .notice.error, #search-results .notice.error")
        if err.count():
            raise AssertionError(f"the console showed an error: {err.first.text_content()}")

    def assert_clean(self) -> None:
        """No dialog opened, no script error, no CSP violation (the console itself never needs one)."""
        assert self.dialogs == [], self.dialogs
        assert self.errors == [], self.errors
        assert self.csp == [], self.csp

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="package")
def ui_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("e14f-world")) as w:
        yield w


@pytest.fixture(scope="package")
def ui_gw(ui_world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_control_gateway(ui_world, tmp_path_factory.mktemp("e14f-gw"))
    try:
        yield gw
    finally:
        stop_gateway(gw)
    # every decision the console's tests made replays the same under the same policies (issue 23, item 1)
    assert_config_replays(gw.config)


# module scope: Playwright's sync API keeps its event loop running in this thread while it is open, so any later
# test of the package calling asyncio.run on the same worker failed ("cannot be called from a running event loop")
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        if IN_CI:
            pytest.fail(f"{CHROMIUM} is missing: scripts/install-test-deps.sh installs chromium-headless-shell")
        pytest.skip(f"{CHROMIUM} is missing (Debian package chromium-headless-shell; scripts/install-test-deps.sh)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # as root Playwright passes --no-sandbox itself (chromium_sandbox defaults to False)
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def console(browser: Any, ui_gw: Gateway) -> Iterator[Callable[[str | None], Console]]:
    """console(role) -> a logged-in Console (role None: not logged in); closed after the test."""
    opened: list[Console] = []

    def make(role: str | None = None) -> Console:
        c = Console(browser, ui_gw)
        opened.append(c)
        return c.login(role) if role else c.open()

    yield make
    for c in opened:
        c.close()
