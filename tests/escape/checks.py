"""Assertions shared by the escape tests.

"Canary untouched" waits a moment before reading the hit logs: a canary logs the TCP accept in its own
process, so a hit caused by a gateway bug can land a few milliseconds after the client got its answer.
"""

from __future__ import annotations

import time
from typing import Any

from tests.networld import Mark, World
from tests.support.http1 import Response
from tests.support.netgateway import Curl, Sandbox

SETTLE = 0.1
ADDRESS_REASONS = {"address_forbidden", "metadata_endpoint"}


def assert_untouched(world: World, mark: Mark, what: str = "") -> None:
    time.sleep(SETTLE)
    hits = world.canary_hits(mark)
    assert hits == [], f"canary hit {what}: {hits}"


def assert_no_requests(world: World, mark: Mark, listener: str, **match: Any) -> None:
    """No request on `listener` since `mark` whose fields equal all of `match` (all requests if empty)."""
    time.sleep(SETTLE)
    found = [h for h in world.hits(mark, listener=listener)
             if h["event"] == "request" and all(h.get(k) == v for k, v in match.items())]
    assert found == [], f"{listener} received {found}"


def requests_on(world: World, mark: Mark, listener: str) -> list[dict[str, Any]]:
    return [h for h in world.hits(mark, listener=listener) if h["event"] == "request"]


def deny_reason(resp: Response | Curl) -> str:
    """The deny contract: status, decision header and the JSON body's reason."""
    if isinstance(resp, Curl):
        assert resp.denied, f"expected a gateway deny: {resp}"
        body = resp.deny_body()
    else:
        assert resp.denied, f"expected a gateway deny: {resp.status} {resp.headers} {resp.body[:300]!r}"
        body = resp.json()
    assert body["error"] == "egress_denied" and body["request_id"] and body["message"], body
    return str(body["reason"])


def assert_denied(resp: Response | Curl, reasons: set[str] | None = None,
                  statuses: tuple[int, ...] = (403, 421)) -> str:
    status = resp.status if isinstance(resp, Response) else (resp.connect_status or resp.status)
    if isinstance(resp, Curl) and resp.connect_status == 200:
        status = resp.status
    assert status in statuses, f"status {status} not in {statuses}: {resp}"
    reason = deny_reason(resp)
    if reasons is not None:
        assert reason in reasons, f"reason {reason!r} not in {reasons}"
    return reason


def proxied_get(sbx: Sandbox | None, url: str, host: str | None = None, extra: str = "") -> bytes:
    """An absolute-form proxy request exactly as written (no client-side normalisation)."""
    host_value = host if host is not None else url.split("/")[2]
    auth = f"Proxy-Authorization: {sbx.auth_header}\r\n" if sbx else ""
    return (f"GET {url} HTTP/1.1\r\nHost: {host_value}\r\n{auth}{extra}Connection: close\r\n\r\n").encode()
