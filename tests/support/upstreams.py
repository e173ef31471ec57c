"""The upstreams of the loopback gateway world (tests/support/gwworld.py): what each one records and answers.

`make_app` is the HTTP/1.1 upstream (echo, big bodies, SSE held open until released, redirects, a
WebSocket echo); `serve_h2` an HTTP/2-only one (the client side then negotiates h2 through the gateway,
which mirrors the upstream's ALPN), including a hostile CONTINUATION flood. Every request lands in a
`Hits` log, which is how a test sees what really reached the upstream (or the canary).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp import web

from tests.support.h2server import serve_h2_events
from tests.support.loopback import Hits


def make_app(hits: Hits, sse_release: dict) -> web.Application:
    async def record(request: web.Request) -> bytes:
        body = b""
        total = 0
        async for chunk in request.content.iter_any():
            total += len(chunk)
            if len(body) < 4096:
                body += chunk[: 4096 - len(body)]
        hits.add({
            "method": request.method, "path": request.path_qs, "host": request.headers.get("Host"),
            "headers": {k.lower(): v for k, v in request.headers.items()}, "body_len": total,
            "body_head": body.decode("latin-1"), "complete": True,
            "peer": request.transport.get_extra_info("peername") if request.transport else None,
        })
        return body

    async def echo(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"method": request.method, "path": request.path_qs,
                                  "headers": {k.lower(): v for k, v in request.headers.items()}})

    async def big(request: web.Request) -> web.StreamResponse:
        await record(request)
        size = int(request.query.get("n", "200000"))
        resp = web.StreamResponse()
        resp.content_length = size
        await resp.prepare(request)
        chunk = b"x" * 65536
        sent = 0
        while sent < size:
            part = chunk[: min(len(chunk), size - sent)]
            await resp.write(part)
            sent += len(part)
        await resp.write_eof()
        return resp

    async def sse(request: web.Request) -> web.StreamResponse:
        await record(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        key = request.query.get("key", "default")
        event = sse_release.setdefault(key, asyncio.Event())
        with contextlib.suppress(TimeoutError):  # `hold`: seconds until it ends on its own (default 10)
            await asyncio.wait_for(event.wait(), float(request.query.get("hold", "10")))
        await resp.write(b"data: last\n\n")
        await resp.write_eof()
        return resp

    async def redirect(request: web.Request) -> web.Response:
        await record(request)
        raise web.HTTPFound(request.query.get("to", "https://other.test/echo"))

    async def ws(request: web.Request) -> web.WebSocketResponse:
        hits.add({"method": "WS", "path": request.path, "host": request.headers.get("Host")})
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for msg in sock:
            hits.add({"method": "WSMSG", "path": request.path, "len": len(msg.data)})
            await sock.send_str(f"echo:{len(msg.data)}")
        return sock

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/big", big)
    app.router.add_get("/sse", sse)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/ws", ws)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


async def serve_h2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hits: Hits) -> None:
    """A minimal HTTP/2-only upstream (h2 state machine over asyncio) so the client side negotiates h2
    through the gateway (mitmproxy mirrors the upstream's ALPN)."""
    import h2.events

    streams: dict[int, dict] = {}
    fields: dict[int, list[tuple[str, str]]] = {}  # the header fields as received, repeats kept

    async def on_event(conn, event) -> bool:
        if isinstance(event, h2.events.RequestReceived):
            streams[event.stream_id] = {k.decode(): v.decode() for k, v in event.headers}
            fields[event.stream_id] = [(k.decode(), v.decode()) for k, v in event.headers]
        elif isinstance(event, h2.events.StreamEnded):
            req = streams.pop(event.stream_id, {})
            hits.add({"method": req.get(":method"), "path": req.get(":path"), "host": req.get(":authority"),
                      "headers": req, "fields": fields.pop(event.stream_id, []), "body_len": 0, "h2": True})
            if req.get(":path") == "/ok/upstream-continuation-flood":
                writer.write(conn.data_to_send())
                hits.add(await continuation_flood(reader, writer, event.stream_id))
                return True
            body = json.dumps({"path": req.get(":path"), "h2": True}).encode()
            conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "application/json"),
                                                ("content-length", str(len(body)))])
            conn.send_data(event.stream_id, body, end_stream=True)
        return False

    await serve_h2_events(reader, writer, on_event)


async def continuation_flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream_id: int,
                             frames: int = 80, frame_bytes: int = 16000) -> dict:
    """A hostile HTTP/2 upstream: a response HEADERS frame without END_HEADERS, then CONTINUATION
    frames one at a time, each followed by 0.2 s to see whether the gateway reacted (GOAWAY, RST_STREAM
    or EOF). Returns how many frames went out before it did: the bound is in the gateway's reaction, not
    in the kernel's socket buffers."""
    from hyperframe.frame import ContinuationFrame, HeadersFrame

    headers = HeadersFrame(stream_id, data=b"\x88")  # ":status: 200", and no END_HEADERS
    writer.write(headers.serialize())
    seen = b""
    for sent in range(1, frames + 1):
        writer.write(ContinuationFrame(stream_id, data=b"\x00" * frame_bytes).serialize())
        try:
            await writer.drain()
            data = await asyncio.wait_for(reader.read(65536), 0.2)
        except TimeoutError:
            continue
        except (ConnectionError, OSError):
            data = b""
        seen += data
        if not data or _has_frame(seen, (0x3, 0x7)):  # EOF, RST_STREAM or GOAWAY
            return {"path": "upstream-flood-result", "frames": sent, "bytes": sent * frame_bytes}
    return {"path": "upstream-flood-result", "frames": frames, "bytes": frames * frame_bytes, "ignored": True}


def _has_frame(data: bytes, types: tuple[int, ...]) -> bool:
    """Whether the HTTP/2 frames in `data` (no preface) include one of `types`."""
    at = 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at:at + 3], "big")
        if data[at + 3] in types:
            return True
        at += 9 + length
    return False
