"""The client matrix's upstreams (tests/runtimes/test_client_matrix.py), one process in the world's `net`
namespace: every protocol an agent's tools speak, over TLS with certificates of the world's CA.

HTTPS on SPEC["http"] (one certificate for every name, routed by path):
- `api.matrix.test`: GET /ok -> "matrix-ok"; POST /upload -> "got <n>";
- `pypi.matrix.test`: a PEP 503 index (/simple/egpkg/ and the wheel under /packages/);
- `npm.matrix.test`: an npm registry (packument /egpkg and its tarball);
- `git.matrix.test`: `git http-backend` (CGI) over a bare repository that accepts pushes;
- `llm.matrix.test`: POST /v1/chat/completions, OpenAI-compatible SSE streaming; it answers 401 unless the
  Authorization header carries the REAL key, and echoes that header's value in its first chunk (the gateway
  must scrub it on the way back);
- `ws.matrix.test`: /echo, a websocket echo.
Anything under a path containing `/private` answers "PRIVATE-REACHED": the policy denies it, so only the
direct control may see it. gRPC on SPEC["grpc"] (`grpc.matrix.test`): /matrix.Echo/Unary, /Stream (N
messages), /Secret (not allowed by the policy).

Every request is logged (JSON lines: host, method, path, body bytes, auth) before it is answered, so the test
can assert what reached an upstream. Prints READY when listening. Usage: matrix_servers.py SPEC.json
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import ssl
import sys
import tarfile
import threading
import time
import zipfile
from concurrent import futures
from typing import Any

import grpc
from aiohttp import web

SPEC: dict[str, Any] = json.loads(open(sys.argv[1]).read()) if __name__ == "__main__" else {}  # noqa: SIM115
REAL_KEY = "sk-real-matrix-0123456789abcdef"
LOCK = threading.Lock()


def log(**record: Any) -> None:
    record["t"] = time.time()
    with LOCK, open(SPEC["log"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


def wheel() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("egpkg/__init__.py", "VALUE = 1\n")
        z.writestr("egpkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: egpkg\nVersion: 1.0\n")
        z.writestr("egpkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: matrix\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr("egpkg-1.0.dist-info/RECORD", "")
    return buf.getvalue()


def npm_tarball() -> bytes:
    buf = io.BytesIO()
    data = json.dumps({"name": "egpkg", "version": "1.0.0", "main": "index.js"}).encode()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, content in (("package/package.json", data), ("package/index.js", b"module.exports = 1;\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(content), 0o644
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


WHEEL, TGZ = wheel(), npm_tarball()
WHEEL_NAME = "egpkg-1.0-py3-none-any.whl"


async def record(request: web.Request) -> bytes:
    body = await request.read()
    log(host=request.host, method=request.method, path=request.path_qs, body=len(body),
        auth=request.headers.get("Authorization", ""))
    return body


@web.middleware
async def private_guard(request: web.Request, handler: Any) -> web.StreamResponse:
    if "/private" in request.path:
        await record(request)
        return web.Response(text="PRIVATE-REACHED")
    return await handler(request)


async def ok(request: web.Request) -> web.Response:
    await record(request)
    return web.Response(text="matrix-ok")


async def upload(request: web.Request) -> web.Response:
    body = await record(request)
    return web.Response(text=f"got {len(body)}")


async def simple(request: web.Request) -> web.Response:
    await record(request)
    digest = hashlib.sha256(WHEEL).hexdigest()
    html = (f'<!DOCTYPE html><html><body><a href="/packages/{WHEEL_NAME}#sha256={digest}">{WHEEL_NAME}</a>'
            "</body></html>")
    return web.Response(text=html, content_type="text/html")


async def package(request: web.Request) -> web.Response:
    await record(request)
    return web.Response(body=WHEEL, content_type="application/octet-stream")


async def packument(request: web.Request) -> web.Response:
    await record(request)
    shasum = hashlib.sha1(TGZ, usedforsecurity=False).hexdigest()
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(TGZ).digest()).decode()
    version = {"name": "egpkg", "version": "1.0.0",
               "dist": {"tarball": "https://npm.matrix.test/egpkg/-/egpkg-1.0.0.tgz", "shasum": shasum,
                        "integrity": integrity}}
    return web.json_response({"name": "egpkg", "dist-tags": {"latest": "1.0.0"}, "versions": {"1.0.0": version}})


async def tarball(request: web.Request) -> web.Response:
    await record(request)
    return web.Response(body=TGZ, content_type="application/octet-stream")


async def git_backend(request: web.Request) -> web.StreamResponse:
    body = await record(request)
    env = {"GIT_PROJECT_ROOT": SPEC["git_root"], "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": request.path,
           "QUERY_STRING": request.query_string, "REQUEST_METHOD": request.method,
           "CONTENT_TYPE": request.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
           "REMOTE_USER": "agent", "REMOTE_ADDR": "198.18.0.1", "HOME": SPEC["git_root"],
           "HTTP_CONTENT_ENCODING": request.headers.get("Content-Encoding", ""),
           "GIT_PROTOCOL": request.headers.get("Git-Protocol", "")}
    proc = await asyncio.create_subprocess_exec("git", "http-backend", env=env, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate(body)
    head, _, payload = out.partition(b"\r\n\r\n")
    if not _:
        head, _, payload = out.partition(b"\n\n")
    resp = web.Response(body=payload)
    for line in head.decode("latin-1").splitlines():
        name, _, value = line.partition(":")
        if name.lower() == "status":
            resp.set_status(int(value.split()[0]))
        elif name:
            resp.headers[name.strip()] = value.strip()
    return resp


async def chat(request: web.Request) -> web.StreamResponse:
    body = await record(request)
    auth = request.headers.get("Authorization", "")
    if auth != f"Bearer {REAL_KEY}":
        return web.json_response({"error": {"message": "bad key", "type": "invalid_request_error"}}, status=401)
    model = json.loads(body).get("model", "m")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, piece in enumerate([f"key={REAL_KEY} ", "hello ", "from ", "matrix"]):
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model,
                 "choices": [{"index": 0, "delta": {"content": piece, **({"role": "assistant"} if i == 0 else {})},
                              "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def echo(request: web.Request) -> web.StreamResponse:
    await record(request)
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    async for msg in ws:
        if msg.type == web.WSMsgType.TEXT:
            await ws.send_str(msg.data)
        elif msg.type == web.WSMsgType.BINARY:
            await ws.send_bytes(msg.data)
    return ws


def grpc_server() -> grpc.Server:
    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        log(host="grpc.matrix.test", method="POST", path="/matrix.Echo/Unary", body=len(request), auth="")
        return b"echo:" + request

    def stream(request: bytes, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        log(host="grpc.matrix.test", method="POST", path="/matrix.Echo/Stream", body=len(request), auth="")
        for i in range(int(request)):
            yield b"%06d" % i

    def secret(request: bytes, context: grpc.ServicerContext) -> bytes:
        log(host="grpc.matrix.test", method="POST", path="/matrix.Echo/Secret", body=len(request), auth="")
        return b"PRIVATE-REACHED"

    handler = grpc.method_handlers_generic_handler("matrix.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Secret": grpc.unary_unary_rpc_method_handler(secret),
    })
    with open(SPEC["key"], "rb") as k, open(SPEC["cert"], "rb") as c:
        creds = grpc.ssl_server_credentials([(k.read(), c.read())])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", 8 * 2**20)])
    server.add_secure_port("{}:{}".format(*SPEC["grpc"]), creds)
    server.add_generic_rpc_handlers((handler,))
    server.start()
    return server


async def main() -> None:
    app = web.Application(middlewares=[private_guard], client_max_size=64 * 2**20)
    app.router.add_get("/ok", ok)
    app.router.add_post("/upload", upload)
    app.router.add_get("/simple/egpkg/", simple)
    app.router.add_get(f"/packages/{WHEEL_NAME}", package)
    app.router.add_get("/egpkg", packument)
    app.router.add_get("/egpkg/-/egpkg-1.0.0.tgz", tarball)
    app.router.add_route("*", "/repo.git/{tail:.*}", git_backend)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/echo", echo)
    app.router.add_route("*", "/{tail:.*}", ok)  # anything else: logged, answered (never a hidden 404)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(SPEC["cert"], SPEC["key"])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, SPEC["http"][0], SPEC["http"][1], ssl_context=ctx).start()
    server = grpc_server()
    print("READY", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        server.stop(None)


if __name__ == "__main__":
    os.umask(0o022)
    asyncio.run(main())
