"""Strict, bounded JSON request bodies for the admin API.

`request.json()` is `json.loads` on whatever arrived: nesting 100,000 levels deep raised RecursionError
(a 500 with a traceback in the log), duplicate keys silently kept the last value (a client and the
gateway could disagree on which `policy` was asked for), and NaN/Infinity and lone surrogates (\\ud800)
were accepted. Every body is checked here first and any problem is a 4xx with a JSON reason:

* size: at most MAX_BODY bytes (413), read with a bound so a huge body is never buffered;
* encoding: strict UTF-8 (400 invalid_encoding);
* depth: counted by a linear scan *before* parsing (json.loads recurses per level), at most MAX_DEPTH;
* syntax: RFC 8259 only — no NaN/Infinity, no duplicate keys (400 invalid_json with the position);
* shape: the top level must be an object (400 invalid_request).
"""

from __future__ import annotations

import json

from aiohttp import web

MAX_BODY = 64 * 1024
MAX_DEPTH = 16  # the admission body is 3 levels deep


class BodyError(Exception):
    """A refused body: `status`, `error` (machine code) and `message` (one sentence)."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message

    def response(self) -> web.Response:
        return web.json_response({"error": self.error, "message": self.message}, status=self.status)


def json_depth(text: str) -> int:
    """Maximum nesting of [ and { outside strings (escapes honoured); linear, no recursion."""
    depth = peak = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            peak = max(peak, depth)
        elif ch in "]}":
            depth -= 1
    return peak


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise BodyError(400, "invalid_json", f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> object:
    raise BodyError(400, "invalid_json", f"{name} is not JSON")


def parse_object(raw: bytes) -> dict:
    """Bytes → dict, or BodyError. Pure (no aiohttp request) so it is testable on its own."""
    if len(raw) > MAX_BODY:
        raise BodyError(413, "body_too_large", f"the body is larger than {MAX_BODY} bytes")
    try:
        text = raw.decode("utf-8")  # strict: invalid bytes and encoded surrogates are errors
    except UnicodeDecodeError as exc:
        raise BodyError(400, "invalid_encoding", f"the body is not UTF-8 (byte {exc.start})") from None
    if json_depth(text) > MAX_DEPTH:
        raise BodyError(400, "invalid_json", f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise BodyError(400, "invalid_json", f"{exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:  # unreachable after the depth scan; a refusal all the same
        raise BodyError(400, "invalid_json", "JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise BodyError(400, "invalid_request", f"the body must be a JSON object, not {type(data).__name__}")
    _check_strings(data)
    return data


def _check_strings(data: object) -> None:
    """`"\\ud800"` is valid JSON syntax but no Unicode text: it would fail later, when the value is
    audited or stored. Refuse it here (iterative walk; depth is already bounded)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise BodyError(400, "invalid_encoding", "a string contains a lone surrogate escape") from None


async def read_object(request: web.Request) -> dict:
    """Read at most MAX_BODY + 1 bytes of the request body and parse it (BodyError on any problem)."""
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise BodyError(413, "body_too_large", f"the body is larger than {MAX_BODY} bytes")
    raw = b""
    while len(raw) <= MAX_BODY and (chunk := await request.content.read(MAX_BODY + 1 - len(raw))):
        raw += chunk
    return parse_object(raw)
