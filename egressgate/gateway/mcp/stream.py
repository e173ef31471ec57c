"""The server-to-client side of a remote MCP route: every JSON-RPC message the upstream sends is parsed
strictly and passed through the session's mediator before the sandbox gets it (tools/list filtered to
the allowed tools, drift and serverInfo recorded), and the gateway's own answers are put in the stream.

mitmproxy hands a streamed body to ONE synchronous callable per chunk (then b"" once at the end), so the
filters here are synchronous: `session.from_server_nowait` filters at once and schedules its async
effects (pins, records), which the session's next `from_client` awaits before it decides anything.

- SSE (`text/event-stream`: streamable HTTP answers and GET streams, the HTTP+SSE transport's stream):
  decoded incrementally (egressgate/mcp/sse.py, bounded per event), filtered per event, re-encoded;
  never buffered whole. Only `message` events (and, on the HTTP+SSE transport, its first `endpoint`
  event) are relayed; an event of another type could carry anything past the filter, so it is dropped.
  Comments become an empty keep-alive comment.
- JSON (`application/json` answers): collected up to `mcp.max_message_bytes`, filtered whole at the end.
Anything the gateway cannot parse, or an `endpoint` event that sends the client's messages to another
origin (or to a path the sandbox may not POST to), cuts the stream: none of it reaches the sandbox, and
the outcome record says why (`egressgate.response_refused`).

The HTTP+SSE transport answers every POST on the stream, so a POST the gateway denies is answered there
too (`Injector`): when nothing of the POST may go upstream, a gateway `ping` (id `egressgate-ping-…`)
goes instead, and the stream replaces the server's answer to that ping with the denials. The upstream
sees a ping, never the denied call; the client gets its error in order, as if the server had sent it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

from egressgate.gateway.shared.credential_streams import StreamFn, as_chunks
from egressgate.mcp.jsonrpc import McpMalformed, dumps, parse_body
from egressgate.mcp.sse import SseDecoder, SseMalformed, comment, encode

logger = logging.getLogger(__name__)

PING_PREFIX = "egressgate-ping-"

Refuse = Callable[[str], None]  # why (a short word for the outcome record): cut the stream


class Injector:
    """Gateway answers waiting for the HTTP+SSE stream of one session."""

    def __init__(self) -> None:
        self.queued: list[dict] = []
        self.pings: dict[str, list[dict]] = {}

    def ping(self, replies: list[dict]) -> bytes:
        """The body to forward instead of a POST the gateway answered whole: a ping whose answer the
        stream swaps for `replies`."""
        ping_id = PING_PREFIX + secrets.token_hex(8)
        self.pings[ping_id] = replies
        return dumps({"jsonrpc": "2.0", "id": ping_id, "method": "ping"})

    def queue(self, replies: list[dict]) -> None:
        self.queued.extend(replies)

    def take(self) -> list[dict]:
        out, self.queued = self.queued, []
        return out


def deliver(session: Any, body: bytes, max_bytes: int, injector: Injector | None) -> tuple[list[dict], bool]:
    """One upstream body (an SSE event's data, or a whole JSON answer) -> the message objects the
    sandbox may see, and whether they form a batch. Raises McpMalformed."""
    out, batch, _ = _deliver(session, body, max_bytes, injector)
    return out, batch


def _deliver(session: Any, body: bytes, max_bytes: int,
             injector: Injector | None) -> tuple[list[dict], bool, bool]:
    """`deliver`, and whether `body` itself may go to the sandbox instead of `dumps()` of the result
    (`passthrough`, below)."""
    messages, batch = parse_body(body, max_bytes=max_bytes)
    out: list[dict] = []
    rest = []
    for message in messages:
        swapped = injector.pings.pop(message.id, None) if (
            injector is not None and message.kind == "response" and isinstance(message.id, str)) else None
        if swapped is not None:
            out.extend(swapped)
        else:
            rest.append(message)
    if rest:
        out.extend(session.from_server_nowait(rest))
    return out, batch, passthrough(body, messages, out)


def passthrough(body: bytes, messages: list[Any], out: list[dict]) -> bool:
    """True when the upstream's own bytes say exactly what re-serializing `out` would (the answer then
    goes out as received, saving a dumps and a copy per answer). The rule: the mediator changed nothing
    (every object out IS the parsed one, in order: no tools/list filtering, no swapped ping, nothing
    dropped), and `body` has no backslash. Given the strict parse (jsonrpc.py: UTF-8, no duplicate keys,
    no NaN, bounded depth...), re-serializing then only changes insignificant whitespace and the spelling
    of numbers, neither of which the gateway decided anything on in an answer: without a backslash every
    string (ids, method names, isError's siblings, a secret the scrub must find) is byte for byte the
    text it decodes to, so the sandbox reads what the gateway read — and the credential scrub, which
    runs on the bytes, sees the decoded text too (an escaped secret like `\\u0073ecret` is the case the
    re-serialization exists for: such a body is still re-encoded)."""
    if len(out) != len(messages) or b"\\" in body:
        return False
    return all(o is m.obj for o, m in zip(out, messages, strict=True))


def sse_filter(inner: StreamFn | None, session: Any, max_bytes: int, first: list[dict],
               injector: Injector | None, on_endpoint: Callable[[bytes], bool] | None,
               refuse: Refuse) -> StreamFn:
    """The stream callable of an SSE answer on an MCP route (compose.py's answer filter): `inner` (the byte
    counter / scrub chain, compose.py's earlier steps) first, then decode -> filter -> encode. `first`:
    gateway answers that go out before anything of the upstream's (denied members of the POST this stream
    answers). `on_endpoint`: the HTTP+SSE transport's endpoint check (None: an `endpoint` event is dropped
    like any unknown event)."""
    decoder = SseDecoder(max_event_bytes=max_bytes)
    pending = list(first)
    dead = False
    endpoint_seen = False

    def run(chunk: bytes) -> object:
        nonlocal dead, pending, endpoint_seen
        if dead:
            return []
        data = b"".join(as_chunks(inner(chunk))) if inner is not None else chunk
        out: list[bytes] = []
        if injector is not None:
            pending += injector.take()
        for reply in pending:
            out.append(encode(dumps(reply)))
        pending = []
        comments = decoder.comments
        try:
            events = decoder.feed(data) if data else []
            for event in events:
                if event.event == "endpoint" and on_endpoint is not None and not endpoint_seen:
                    if not on_endpoint(event.data):
                        dead = True
                        refuse("mcp_endpoint_refused")
                        return []
                    endpoint_seen = True
                    out.append(encode(event.data, event="endpoint", id=event.id, retry=event.retry))
                    continue
                if event.event != "message":
                    logger.info("dropped an SSE event of type %r on an MCP stream", event.event[:40])
                    continue
                objs, batch, same = _deliver(session, event.data, max_bytes, injector)
                if same and objs and (batch or len(objs) == 1):  # as received (see `passthrough`)
                    out.append(encode(event.data, id=event.id, retry=event.retry))
                    continue
                if batch and objs:
                    out.append(encode(dumps(objs), id=event.id, retry=event.retry))
                    continue
                for i, obj in enumerate(objs):
                    out.append(encode(dumps(obj), id=event.id if i == 0 else None,
                                      retry=event.retry if i == 0 else None))
        except (McpMalformed, SseMalformed) as exc:
            dead = True
            logger.warning("cut an MCP stream: the server sent %s", exc)
            refuse("mcp_malformed_server_message")
            return []
        if injector is not None:  # answers the events above released (a swapped ping) go right after
            out.extend(encode(dumps(reply)) for reply in injector.take())
        if not out and decoder.comments > comments:
            out.append(comment())
        return out

    return run


def json_answer(session: Any, body: bytes, max_bytes: int, replies: list[dict], batch: bool) -> bytes:
    """A whole JSON answer of the upstream, filtered, with the gateway's `replies` merged in (the client
    sent a batch: one array; else the one message there is). Raises McpMalformed."""
    if not body.strip() and not replies:
        return body  # nothing to filter (an empty 202 / 200 answer to notifications)
    objs: list[dict] = []
    if body.strip():
        objs, upstream_batch, same = _deliver(session, body, max_bytes, None)
        if same and not replies and upstream_batch == batch and (batch or len(objs) == 1):
            return body  # as received (see `passthrough`): nothing merged, the same framing
        batch = batch or upstream_batch
    objs = objs + replies
    if batch:
        return dumps(objs)
    if len(objs) != 1:
        raise McpMalformed("answer_count", f"{len(objs)} messages answer a single request")
    return dumps(objs[0])


def json_collector(inner: StreamFn | None, max_bytes: int, finish: Callable[[bytes], bytes],
                   refuse: Refuse) -> StreamFn:
    """The stream callable of a JSON answer too large or of unknown length to be buffered by mitmproxy:
    collected here up to `max_bytes` (over it: cut), filtered whole at the end (`finish`)."""
    buf = bytearray()
    dead = False

    def run(chunk: bytes) -> object:
        nonlocal dead
        if dead:
            return []
        buf.extend(b"".join(as_chunks(inner(chunk))) if inner is not None else chunk)
        if len(buf) > max_bytes:
            dead = True
            buf.clear()
            refuse("mcp_answer_too_large")
            return []
        if chunk != b"":
            return []
        try:
            return [finish(bytes(buf))]
        except McpMalformed as exc:
            dead = True
            logger.warning("cut an MCP answer: the server sent %s", exc)
            refuse("mcp_malformed_server_message")
            return []

    return run
