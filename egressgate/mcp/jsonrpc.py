"""Strict JSON-RPC 2.0 parsing for MCP messages: the one parser whose reading is decided and forwarded.

Why strict: the gateway decides a `tools/call` on ITS reading of the body, and the MCP server acts on
its own. Any input two JSON parsers may read differently is a way to get one call decided and another
executed, so every such input is refused (McpMalformed), never guessed at:

- bytes: UTF-8 only; no BOM (some parsers skip it, some fail); no encoded surrogates (strict decode);
- duplicate object keys at ANY depth (`{"name":"search","name":"delete"}`: first-wins vs last-wins);
- lone surrogates made by `\\ud800` escapes (lossy or refused by the other side's decoder);
- NaN / Infinity / numbers that overflow a double (not JSON; Python accepts them by default);
- depth above `max_depth` and bodies above `max_bytes` (bounded work, bounded memory);
- envelope: "jsonrpc" exactly "2.0", no members beyond jsonrpc/id/method/params/result/error, an id
  that is a string or an integer within +-(2^53-1) (never a float, bool or null on a request), no
  result/error on a request, no method on a response, params an object, `tools/call` never as a
  notification (a call nobody answers would run unrecorded), an empty batch, a non-object batch
  member, two requests in one batch with the same id (the second call's outcome would hide behind
  the first's).

What the gateway forwards is `dumps()` of the parsed objects: the server parses exactly what was
decided, never the sandbox's original bytes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

JSONRPC_VERSION = "2.0"
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
DENIED = -32001  # egressgate's refusal of a well-formed message (data.reason says why)
DEFAULT_MAX_DEPTH = 64
ENVELOPE = frozenset({"jsonrpc", "id", "method", "params", "result", "error"})
CALL_PARAMS = frozenset({"name", "arguments", "_meta", "task"})
TOOLS_CALL = "tools/call"
_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")
# a \u escape of a surrogate (upper or lower case hex): only then can decoded text hold a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class McpMalformed(ValueError):
    """A message the gateway refuses to interpret. `detail` is a short machine word (audit, tests);
    `parse_error` says whether JSON itself failed (-32700) or the JSON-RPC envelope (-32600)."""

    def __init__(self, detail: str, message: str, *, parse_error: bool = False) -> None:
        super().__init__(f"{detail}: {message}")
        self.detail = detail
        self.message = message
        self.parse_error = parse_error

    @property
    def code(self) -> int:
        return PARSE_ERROR if self.parse_error else INVALID_REQUEST


@dataclass(frozen=True, slots=True)
class Message:
    kind: str  # "request" | "notification" | "response"
    id: int | str | None
    method: str | None
    params: Any
    result: Any
    error: Any
    obj: dict

    @property
    def is_call(self) -> bool:
        return self.kind == "request" and self.method == TOOLS_CALL


def _json_error(detail: str, message: str) -> McpMalformed:
    return McpMalformed(detail, message, parse_error=True)


def _pairs(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _json_error("duplicate_key", f"object key {dup[:64]!r} appears twice")
    return obj


def _constant(name: str) -> Any:
    raise _json_error("non_finite", f"{name} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _json_error("non_finite", "a number overflows a double")
    return value


def _walk(root: Any, max_depth: int, check_strings: bool) -> None:
    """Depth of every container, and (when escapes could have made one) lone surrogates in every
    string, key or value. Iterative: a deep document must not exhaust the Python stack here."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > max_depth:
                raise _json_error("depth", f"nested deeper than {max_depth}")
            for key, value in node.items():
                if check_strings and _SURROGATE.search(key):
                    raise _json_error("surrogate", "a \\u escape makes a lone surrogate (not Unicode text)")
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            if depth > max_depth:
                raise _json_error("depth", f"nested deeper than {max_depth}")
            stack.extend((value, depth + 1) for value in node)
        elif check_strings and isinstance(node, str) and _SURROGATE.search(node):
            raise _json_error("surrogate", "a \\u escape makes a lone surrogate (not Unicode text)")


def loads_strict(body: bytes, *, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Any JSON value under the rules above (the JSON half of parse_body; also used for SSE data)."""
    if len(body) > max_bytes:
        raise _json_error("too_large", f"message of {len(body)} bytes is over the {max_bytes}-byte limit")
    if body.startswith(_BOM):
        raise _json_error("bom", "a UTF-8 byte order mark precedes the JSON")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _json_error("not_utf8", f"not UTF-8 at byte {exc.start}") from None
    try:
        value = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant, parse_float=_float)
    except McpMalformed:
        raise
    except RecursionError:
        raise _json_error("depth", f"nested deeper than {max_depth}") from None
    except ValueError as exc:  # JSONDecodeError, and int() over the digit limit
        raise _json_error("syntax", str(exc)[:120]) from None
    escapes = _SURROGATE_ESCAPE.search(body) is not None
    # fewer brackets than the limit cannot nest deeper than it: most messages skip the walk entirely
    if escapes or body.count(b"{") + body.count(b"[") > max_depth:
        _walk(value, max_depth, escapes)
    return value


# An integer id a JavaScript server reads as a double is exact only up to 2^53: two calls with ids that
# round to one number would have one answer, so whose outcome is it? Larger integers are refused.
MAX_SAFE_ID = 2**53 - 1


def _valid_id(value: Any) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_SAFE_ID <= value <= MAX_SAFE_ID


def message_from(obj: Any) -> Message:
    """One JSON-RPC message from a parsed JSON value, or McpMalformed."""
    if not isinstance(obj, dict):
        raise McpMalformed("not_object", "a JSON-RPC message must be a JSON object")
    if obj.get("jsonrpc") != JSONRPC_VERSION:
        raise McpMalformed("jsonrpc_version", 'the "jsonrpc" member must be exactly "2.0"')
    unknown = obj.keys() - ENVELOPE
    if unknown:
        raise McpMalformed("unknown_member", f"unknown top-level member {sorted(unknown)[0][:64]!r}")
    has_answer = "result" in obj or "error" in obj
    method = obj.get("method")
    if "method" in obj and isinstance(method, str) and not has_answer:
        return _request(obj, method)
    if "method" in obj and isinstance(method, str):
        raise McpMalformed("result_on_request", "a request or notification carries result/error")
    if "method" in obj:
        raise McpMalformed("method_on_response" if has_answer else "method_type",
                           "a response carries a method member" if has_answer else "method must be a string")
    return _response(obj)


def _request(obj: dict, method: str) -> Message:
    if not method:
        raise McpMalformed("method_type", "method must be a non-empty string")
    params = obj.get("params")
    if "params" in obj and not isinstance(params, dict):
        raise McpMalformed("params_type", "params must be a JSON object")
    if "id" not in obj:
        if method == TOOLS_CALL:
            raise McpMalformed("call_notification", "tools/call sent as a notification (no id): it must be a request")
        return Message("notification", None, method, params, None, None, obj)
    if not _valid_id(obj["id"]):
        raise McpMalformed("id_type", "a request id must be a string or an integer")
    if method == TOOLS_CALL:
        _check_call_params(params)
    return Message("request", obj["id"], method, params, None, None, obj)


def _check_call_params(params: Any) -> None:
    if not isinstance(params, dict) or not isinstance(params.get("name"), str) or not params["name"]:
        raise McpMalformed("call_params", "tools/call needs params.name (a non-empty string)")
    if "arguments" in params and not isinstance(params["arguments"], dict):
        raise McpMalformed("call_params", "tools/call params.arguments must be a JSON object")
    unknown = params.keys() - CALL_PARAMS
    if unknown:
        raise McpMalformed("call_params_member", f"tools/call params has unknown member {sorted(unknown)[0][:64]!r}")


def _response(obj: dict) -> Message:
    if "params" in obj:
        raise McpMalformed("params_on_response", "a response carries params")
    if ("result" in obj) == ("error" in obj):
        raise McpMalformed("response_shape", "a response has exactly one of result and error")
    if "id" not in obj:
        raise McpMalformed("id_type", "a response needs an id")
    rid = obj["id"]
    if "error" in obj:
        error = obj["error"]
        if (not isinstance(error, dict) or type(error.get("code")) is not int
                or not isinstance(error.get("message"), str)):
            raise McpMalformed("error_shape", "error must be an object with an integer code and a string message")
        if rid is not None and not _valid_id(rid):
            raise McpMalformed("id_type", "a response id must be a string, an integer or null")
        return Message("response", rid, None, None, None, error, obj)
    if not _valid_id(rid):
        raise McpMalformed("id_type", "a response id must be a string or an integer")
    return Message("response", rid, None, None, obj["result"], None, obj)


def parse_value(value: Any) -> tuple[list[Message], bool]:
    """Messages from an already strictly parsed JSON value: (messages, was_batch)."""
    if isinstance(value, list):
        if not value:
            raise McpMalformed("empty_batch", "an empty batch")
        messages = []
        for member in value:
            if not isinstance(member, dict):
                raise McpMalformed("batch_member", "every batch member must be a JSON object")
            messages.append(message_from(member))
        ids = [m.id for m in messages if m.kind == "request"]
        if len(set(ids)) != len(ids):
            raise McpMalformed("duplicate_id", "two requests in one batch share an id")
        return messages, True
    return [message_from(value)], False


def parse_body(body: bytes, *, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH) -> tuple[list[Message], bool]:
    """A whole HTTP body or stdio line: (messages, was_batch). A batch with one bad member is refused
    whole (McpMalformed): never a partial guess."""
    return parse_value(loads_strict(body, max_bytes=max_bytes, max_depth=max_depth))


def dumps(obj: Any) -> bytes:
    """Canonical bytes for what is forwarded: member order kept, compact, UTF-8 (no ASCII escaping).
    Strings are surrogate-free (parse refused them), so encoding cannot fail."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def error_response(id: int | str | None, code: int, message: str, data: dict | None = None) -> dict:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": JSONRPC_VERSION, "id": id, "error": error}


def deny_error(id: int | str | None, message: str, reason: str, rule: str | None,
               approval_id: str | None = None, code: int = DENIED) -> dict:
    """The JSON-RPC error an agent can act on (PLAN-13): reason code, rule, approval id if any."""
    data: dict[str, Any] = {"reason": reason, "rule": rule, "egressgate": True}
    if approval_id is not None:
        data["approval_id"] = approval_id
    return error_response(id, code, message, data)


def reply_id(body: bytes, max_bytes: int) -> int | str | None:
    """The id to answer a refused body with, so the client's pending request fails at once instead of
    timing out: a lenient reading of a single message's id. Only ever used to ADDRESS the error reply,
    never to decide or forward anything; None for a batch or anything unreadable (JSON-RPC: id null)."""
    if len(body) > max_bytes:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if rid is not None and _valid_id(rid) else None


def malformed_error(exc: McpMalformed, id: int | str | None = None) -> dict:
    return deny_error(id, f"Refused a malformed MCP message ({exc.detail}): {exc.message}; send one strict "
                      "JSON-RPC 2.0 message.", "mcp_malformed", None, code=exc.code)
