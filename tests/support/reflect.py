"""The reflecting upstreams of the credential world (tests/support/credworld.py).

They record what they received (a `Hits` log) and answer with the credential the gateway placed,
*reflected* in every encoding the response scrubber must catch (base64, url, json, hex, chunked and
compressed, in headers, reason phrases, redirects, WebSocket data and control frames, HTTP/2 DATA), so a
test sees a leak as the credential reaching the sandbox.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import time
import zlib
from urllib.parse import quote

import httpx
from aiohttp import web

from tests.support.h2server import serve_h2_events
from tests.support.jwtcheck import TokenRejected, verify
from tests.support.loopback import Hits
from tests.support.mixed import EVERY, HTML, JSON, URL, mixed


def secret_of(request: web.Request) -> str:
    """The credential the gateway placed (Bearer, Basic password or api_key query parameter)."""
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[7:]
    if auth.startswith("Basic "):
        return base64.b64decode(auth[6:]).decode().partition(":")[2]
    return request.query.get("api_key", "")


MIXED_PAD = 40


def mixed_reflection(kind: str, s: str) -> tuple[bytes, str, list[bytes]]:
    """(body, content type, the mixed forms in it) an echo upstream sends for /reflect/mixed-<kind>:
    the credential with some characters escaped — JSON, HTML (attribute and text), a form body; `split`
    is every style at once, padded, for the chunk-boundary test."""
    if kind == "json":
        forms = [mixed(s, JSON), mixed(s, JSON, 2)]
        return f'{{"token": "{forms[0]}", "echo": ["{forms[1]}"]}}'.encode(), "application/json", _b(forms)
    if kind == "html":
        forms = [mixed(s, HTML), mixed(s, HTML, 3)]
        body = f'<html><body><p title="{forms[0]}">{forms[1]}</p></body></html>'
        return body.encode(), "text/html", _b(forms)
    if kind == "form":
        forms = [mixed(s, URL), mixed(s, URL, 1)]
        return f"a=1&token={forms[0]}&b={forms[1]}".encode(), "application/x-www-form-urlencoded", _b(forms)
    if kind == "split":
        forms = [mixed(s, EVERY)]
        return b"x" * MIXED_PAD + forms[0].encode() + b"y" * MIXED_PAD, "text/plain", _b(forms)
    raise KeyError(kind)


def _b(forms: list[str]) -> list[bytes]:
    return [f.encode() for f in forms]


def make_app(hits: Hits, jwks_url: dict) -> web.Application:
    async def record(request: web.Request) -> bytes:
        body = await request.read()
        hits.add({
            "method": request.method, "host": request.headers.get("Host"), "path": request.path,
            "query": request.query_string, "auth": request.headers.getall("Authorization", []),
            "headers": [(k.lower(), v) for k, v in request.headers.items()], "body": body,
            "port": request.transport.get_extra_info("sockname")[1] if request.transport else None,
        })
        return body

    async def echo(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"ok": True, "path": request.path})

    async def reflect(request: web.Request) -> web.StreamResponse:
        """Reflect the received credential in the encoding `mode` names."""
        await record(request)
        s = secret_of(request)
        mode = request.match_info["mode"]
        forms = {
            "plain": s.encode(),
            "b64": base64.b64encode(s.encode()),
            "b64url": base64.urlsafe_b64encode(s.encode()).rstrip(b"="),
            "url": quote(s, safe="").encode(),
            "json": json.dumps({"token": s}).encode(),
            "jsonslash": json.dumps({"token": s}).replace("/", "\\/").encode(),
            "hex": s.encode().hex().encode(),
            "basic": base64.b64encode(f"x-access-token:{s}".encode()),
            "embedded": base64.b64encode(b'{"k": 1, "echo": "' + s.encode() + b'", "z": 2}'),
        }
        if mode in forms:
            return web.Response(body=b"before " + forms[mode] + b" after", content_type="text/plain")
        if mode == "mixed-headers":
            return web.Response(text="ok", headers={
                "Location": f"https://other.test/cb?token={mixed(s, URL, 1)}", "Set-Cookie": f"t={mixed(s, HTML, 1)}"})
        if mode == "mixed-split":  # two chunks cut at ?cut=N, apart in time: two reads at the gateway
            body, ctype, _ = mixed_reflection("split", s)
            cut = int(request.query["cut"])
            resp = web.StreamResponse(headers={"Content-Type": ctype})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for part in (body[:cut], body[cut:]):
                if part:
                    await resp.write(part)
                    await asyncio.sleep(0.002)
            await resp.write_eof()
            return resp
        if mode.startswith("mixed-"):
            body, ctype, _ = mixed_reflection(mode[6:], s)
            return web.Response(body=body, headers={"Content-Type": ctype})
        if mode == "reason":
            return web.Response(text="ok", reason=f"OK {s}")
        if mode == "headers":
            return web.Response(text="ok", headers={
                "X-Echo": s, "Location": f"https://other.test/cb?token={quote(s, safe='')}",
                "Set-Cookie": f"session={s}; Path=/", "WWW-Authenticate": f'Bearer error="{s}"'})
        if mode in ("chunks", "gzip-chunks", "deflate-chunks"):
            payload = b"x" * 1000 + b"[" + s.encode() + b"]" + json.dumps(s).encode() + b"y" * 1000
            headers = {"Content-Type": "text/plain"}
            if mode == "gzip-chunks":
                payload = gzip.compress(payload)
                headers["Content-Encoding"] = "gzip"
            elif mode == "deflate-chunks":
                payload = zlib.compress(payload)
                headers["Content-Encoding"] = "deflate"
            resp = web.StreamResponse(headers=headers)
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            step = int(request.query.get("step", "7"))
            for i in range(0, len(payload), step):
                await resp.write(payload[i:i + step])
                if i % (step * 20) == 0:
                    await asyncio.sleep(0.001)  # make the chunks separate reads at the gateway
            await resp.write_eof()
            return resp
        if mode == "gzip":
            body = gzip.compress(b"echo:" + s.encode() + b":" + base64.b64encode(s.encode()))
            return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})
        if mode == "compress":
            return web.Response(body=b"\x1f\x9d" + s.encode(), headers={"Content-Encoding": "compress"})
        if mode == "redirect":
            raise web.HTTPFound(f"https://other.test:{request.url.port}/echo?leak={quote(s, safe='')}")
        raise web.HTTPNotFound()

    async def redirect(request: web.Request) -> web.Response:
        await record(request)
        raise web.HTTPFound(request.query["to"])

    async def check_jwt(request: web.Request) -> web.Response:
        """The upstream of a `jwt` capability: verifies with the gateway's JWKS (fetched directly from
        the admin API, as a real service would) and answers with the claims it accepted."""
        await record(request)
        async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
            jwks = (await client.get(jwks_url["url"])).json()
        try:
            claims = verify(secret_of(request), jwks, audience=request.headers["Host"].split(":")[0],
                            now=time.time())
        except TokenRejected as exc:
            return web.json_response({"rejected": str(exc)}, status=401)
        return web.json_response({k: claims[k] for k in ("sub", "aud", "iat", "exp", "iss", "jti")})

    async def ws(request: web.Request) -> web.WebSocketResponse:
        """Echoes each message together with the credential it was opened with (a reflecting server)."""
        await record(request)
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        s = secret_of(request)
        async for msg in sock:
            hits.add({"method": "WSMSG", "host": request.headers.get("Host"), "path": request.path, "query": "",
                      "auth": [], "headers": [], "body": str(msg.data).encode(), "port": None})
            await sock.send_str(f"echo {msg.data} auth={s} b64={base64.b64encode(s.encode()).decode()}")
        return sock

    async def wsctl(request: web.Request) -> web.WebSocketResponse:
        """Reflects the credential it was opened with in *control* frames: the text commands `ping`,
        `pong` and `close` make it send a Ping, a Pong or a Close (code 4000) whose payload / reason is
        `auth=<credential> b64=<base64 of it>`. Records every control frame it receives (WSCTL hits)."""
        await record(request)
        sock = web.WebSocketResponse(autoping=False, autoclose=False)
        await sock.prepare(request)
        s = secret_of(request)
        echo = f"auth={s} b64={base64.b64encode(s.encode()).decode()}".encode()
        while True:
            msg = await sock.receive()
            if msg.type in (web.WSMsgType.PING, web.WSMsgType.PONG, web.WSMsgType.CLOSE):
                kind = msg.type.name.lower()
                data = str(msg.extra or "").encode() if kind == "close" else bytes(msg.data)
                hits.add({"method": "WSCTL", "host": request.headers.get("Host"), "path": request.path,
                          "query": kind, "auth": [], "headers": [], "body": data,
                          "code": msg.data if kind == "close" else None, "port": None})
            if msg.type == web.WSMsgType.PING:
                await sock.pong(msg.data)
            elif msg.type == web.WSMsgType.TEXT and msg.data in ("ping", "pong"):
                await (sock.ping(echo) if msg.data == "ping" else sock.pong(echo))
            elif msg.type == web.WSMsgType.TEXT and msg.data == "close":
                await sock.close(code=4000, message=echo)
                break
            elif msg.type in (web.WSMsgType.CLOSE, web.WSMsgType.CLOSING, web.WSMsgType.CLOSED,
                              web.WSMsgType.ERROR):
                await sock.close()
                break
        return sock

    app = web.Application(client_max_size=1 << 24)
    app.router.add_get("/ws", ws)
    app.router.add_get("/wsctl", wsctl)
    app.router.add_route("*", "/reflect/{mode}", reflect)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/jwt", check_jwt)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


async def serve_h2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hits: Hits) -> None:
    """An HTTP/2-only reflecting upstream: /h2/chunks streams the credential split over DATA frames (no
    content-length), /h2/gzip sends it gzip-compressed; the client side then negotiates h2 too."""
    import h2.events

    streams: dict[int, list] = {}

    async def on_event(conn, event) -> bool:
        if isinstance(event, h2.events.RequestReceived):
            streams[event.stream_id] = [(k.decode(), v.decode()) for k, v in event.headers]
        elif isinstance(event, h2.events.StreamEnded):
            req = streams.pop(event.stream_id, [])
            d = dict(req)
            auth = [v for k, v in req if k == "authorization"]
            hits.add({"method": d.get(":method"), "host": d.get(":authority"), "path": d.get(":path"),
                      "query": "", "auth": auth, "headers": req, "body": b"", "port": None})
            s = auth[0][7:] if auth and auth[0].startswith("Bearer ") else ""
            payload = b"x" * 1000 + s.encode() + base64.b64encode(s.encode()) + b"y" * 1000
            headers = [(":status", "200"), ("content-type", "text/plain")]
            if d.get(":path") == "/h2/gzip":
                payload = gzip.compress(payload)
                headers.append(("content-encoding", "gzip"))
            conn.send_headers(event.stream_id, headers)
            for i in range(0, len(payload), 5):
                conn.send_data(event.stream_id, payload[i:i + 5])
                if i % 50 == 0:
                    writer.write(conn.data_to_send())
                    await writer.drain()
                    await asyncio.sleep(0)
            conn.end_stream(event.stream_id)
        return False

    await serve_h2_events(reader, writer, on_event)
