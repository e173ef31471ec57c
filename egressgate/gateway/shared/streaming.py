"""Decide which responses stream: nothing large is ever buffered whole, and SSE is never delayed.

Streamed: every `text/event-stream` response (an agent waits for the first event, not the last), every
body larger than 64 KiB, and every body of unknown length (chunked / read-until-close / HTTP/2 without
content-length), since its size is only known once it has been buffered — too late. Small bodies with
a known length are buffered so a later addon (the credential broker's redaction) can see them whole.
budgets.py records the verdict (`FlowState.stream_response`, next to the request body's plan); compose.py
builds the callable (count, scrub).
"""

from __future__ import annotations

from mitmproxy import http

STREAM_THRESHOLD = 64 * 1024


def should_stream(flow: http.HTTPFlow) -> bool:
    response = flow.response
    assert response is not None
    if flow.request.method == "HEAD" or response.status_code in (204, 304) or 100 <= response.status_code < 200:
        return False
    content_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type == "text/event-stream":
        return True
    if "transfer-encoding" in response.headers:
        return True
    raw = response.headers.get("content-length")
    if raw is None:
        return True
    try:
        return int(raw) > STREAM_THRESHOLD
    except ValueError:
        return True

