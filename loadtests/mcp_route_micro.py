"""The MCP route's per-request steps that h13-perf changed, timed in-process (min of repeats: robust to a
loaded machine, unlike the gateway bench). Run the same file against two trees and compare:

    PYTHONPATH=<tree> .venv/bin/python loadtests/mcp_route_micro.py

Rows: the header questions the route asks of a POST and of its JSON answer; the JSON answer path of an
answered tools/call (strict parse, the mediator's unchanged object, serialize or pass through, set the
body); setting the forwarded request body when the client already sent the canonical spelling. The
session is a stand-in that returns the parsed objects unchanged (what the mediator does for a tool
call's answer); the mediator's own cost is `python -m loadtests.mcp_bench mediator`.
"""

from __future__ import annotations

import json
import timeit

from mitmproxy import http

import egressgate.gateway.mcp.answer as answer
import egressgate.gateway.mcp.route as route
from egressgate.gateway.mcp import stream as mcp_stream

NEW = hasattr(mcp_stream, "passthrough")
BODY = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
    "name": "search_tickets", "arguments": {
    "project": "acme", "limit": 10, "status": "open", "query": "printer on fire", "path": "/workspace/reports/q3.csv",
    "url": "https://up.test/mcp"}}}, separators=(",", ":")).encode()
REQ = http.Request.make("POST", "https://up.test:443/mcp", BODY, {
    "host": "up.test", "user-agent": "python-httpx/0.28", "accept": "application/json, text/event-stream",
    "accept-encoding": "gzip, deflate", "connection": "keep-alive", "content-type": "application/json",
    "mcp-protocol-version": "2025-06-18", "proxy-authorization": "Basic xxx"})
RESULT = json.dumps({"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": "3 open tickets"}],
                                                           "isError": False}}, separators=(",", ":")).encode()
RESP = http.Response.make(200, RESULT, {"content-type": "application/json", "date": "Tue, 01 Dec 2026 00:00:00 GMT",
                                        "server": "uvicorn", "mcp-session-id": "abc"})


def headers_old() -> None:
    h = REQ.headers
    _ = "upgrade" in h, h.get("mcp-session-id"), route.body_problem(REQ, 1 << 20)  # type: ignore[arg-type]
    _ = RESP.headers.get("mcp-session-id"), answer.content_type(RESP), answer.coded(RESP)  # type: ignore[attr-defined]
    _ = answer.content_type(RESP)  # type: ignore[attr-defined]


def headers_new() -> None:
    from egressgate.gateway.mcp.headers import HeaderView

    h = HeaderView(REQ)
    _ = b"upgrade" in h, h.get(b"mcp-session-id"), route.body_problem(h, 1 << 20)
    r = HeaderView(RESP)
    _ = r.get(b"mcp-session-id"), r.content_type(), r.coded()
    r2 = HeaderView(RESP)
    _ = r2.content_type(), r2.get(b"content-length")


class Session:
    def from_server_nowait(self, messages: list) -> list[dict]:
        return [m.obj for m in messages]


SESSION = Session()


def answer_path() -> None:
    out = mcp_stream.json_answer(SESSION, RESULT, 1 << 20, [], False)
    if not NEW or out != RESP.raw_content or RESP.headers.get("content-length") != str(len(out)):
        RESP.content = out


def request_set() -> None:
    forward = bytes(BODY)  # the canonical bytes of a compact client equal its body
    if not NEW or forward != BODY:
        REQ.content = forward


def main() -> None:
    for name, fn in (("header reads (request + answer)", headers_new if NEW else headers_old),
                     ("JSON answer: parse, filter, (re)serialize, set", answer_path),
                     ("request body set (compact client)", request_set)):
        us = min(timeit.repeat(fn, number=5000, repeat=7)) / 5000 * 1e6
        print(f"{'branch' if NEW else 'base'} {name:<48} {us:6.2f} us")


if __name__ == "__main__":
    main()
