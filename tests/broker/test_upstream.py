"""Broker + injection + redaction composed over real loopback sockets, as the gateway will wire them.

A test upstream verifies minted JWTs with the broker's JWKS; an echo upstream reflects everything it got
(headers, body, a Location and a Set-Cookie built from the credential, in tiny chunks, optionally gzip).
What reaches the client after `scrub_headers` + `scrubbing_stream` must contain no encoding of the value.
"""

from __future__ import annotations

import base64
import gzip
import json
import time
from urllib.parse import quote

import httpx
import pytest
from aiohttp import web
from pydantic import TypeAdapter

from egressgate.broker.broker import Broker
from egressgate.broker.config import Capability
from egressgate.broker.decompress import scrubbing_stream
from egressgate.broker.inject import inject
from egressgate.broker.redact import Scrubber, SecretSpec
from tests.support import jwtcheck
from tests.support.bao import KV_CAP, KV_SECRET, BaoServer, vault_config
from tests.support.leaks import leaks

CAP = TypeAdapter(Capability)
JWT_CAP = CAP.validate_python({"type": "jwt", "ttl_seconds": 60})
BASIC_KV = CAP.validate_python(
    {
        "type": "static",
        "source": {"vault": {"path": "egressgate/openai", "field": "api_key"}},
        "placement": {"basic": {"username": "svc"}},
    }
)


@pytest.fixture
async def broker(bao: BaoServer):
    b = Broker.from_config(vault_config(bao))
    await b.start()
    yield b
    await b.aclose()


async def serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def test_upstream_verifies_injected_jwt(broker: Broker) -> None:
    jwks = await broker.jwks()

    async def verify(request: web.Request) -> web.Response:
        auth = request.headers.getall("Authorization", [])
        if len(auth) != 1 or not auth[0].startswith("Bearer "):
            return web.json_response({"error": "want exactly one bearer"}, status=401)
        try:
            claims = jwtcheck.verify(auth[0][7:], jwks, audience="api.example.test", now=time.time())
        except jwtcheck.TokenRejected as exc:
            return web.json_response({"error": str(exc)}, status=401)
        return web.json_response({"sub": claims["sub"]})

    app = web.Application()
    app.router.add_get("/verify", verify)
    runner, base = await serve(app)
    try:
        cred = await broker.issue("svc", JWT_CAP, "sbx-9", "api.example.test", time.time())
        sent = [("Authorization", "Bearer sandbox-made-this-up"), ("Accept", "application/json")]
        inj = inject(JWT_CAP, cred, sent, [])
        async with httpx.AsyncClient(trust_env=False) as client:
            ok = await client.get(f"{base}/verify", headers=inj.headers)
            assert ok.status_code == 200 and ok.json() == {"sub": "sbx-9"}
            # positive control: what the sandbox sent on its own is rejected by the same upstream
            bad = await client.get(f"{base}/verify", headers=sent)
            assert bad.status_code == 401
            other = await broker.issue("svc", JWT_CAP, "sbx-9", "other.example.test", time.time())
            wrong_aud = await client.get(f"{base}/verify", headers=inject(JWT_CAP, other, sent, []).headers)
            assert wrong_aud.status_code == 401 and "aud" in wrong_aud.json()["error"]
    finally:
        await runner.cleanup()


def echo_app() -> web.Application:
    async def echo(request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        body = await request.read()
        secret = base64.b64decode(auth[6:]).decode().split(":", 1)[1] if auth.startswith("Basic ") else ""
        doc = json.dumps(
            {
                "headers": dict(request.headers),
                "body": body.decode(),
                "b64": base64.b64encode(secret.encode()).decode(),
                "nested_b64": base64.b64encode(json.dumps({"k": secret}).encode()).decode(),
                "url": quote(secret, safe=""),
            }
        ).encode()
        if request.query.get("gzip"):
            doc = gzip.compress(doc)
        resp = web.StreamResponse(
            headers={
                "Location": f"https://cb.example.test/?t={quote(secret, safe='')}",
                "Set-Cookie": f"a={auth[6:]}; HttpOnly",
                "X-Echo": auth,
                **({"Content-Encoding": "gzip"} if request.query.get("gzip") else {}),
            }
        )
        await resp.prepare(request)
        for i in range(0, len(doc), 7):  # tiny chunks: secrets straddle chunk boundaries
            await resp.write(doc[i : i + 7])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/echo", echo)
    return app


@pytest.mark.parametrize("compressed", [False, True])
async def test_echo_upstream_reflection_is_scrubbed(broker: Broker, compressed: bool) -> None:
    cred = await broker.issue("kv", BASIC_KV, "sbx-1", "echo.example.test", time.time())
    assert cred.value == KV_SECRET
    inj = inject(BASIC_KV, cred, [("Content-Type", "application/json")], [])
    scrubber = Scrubber([SecretSpec(cred.value, "svc")])
    runner, base = await serve(echo_app())
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            url = f"{base}/echo" + ("?gzip=1" if compressed else "")
            body = json.dumps({"note": f"the agent pasted {cred.value} here"})  # e.g. a 4xx echoing input
            async with client.stream("POST", url, headers=inj.headers, content=body) as resp:
                raw_chunks = [c async for c in resp.aiter_raw()]
                headers = scrubber.scrub_headers(resp.headers.multi_items())
                encoding = resp.headers.get("content-encoding")
    finally:
        await runner.cleanup()
    raw = b"".join(raw_chunks)
    # positive control: unscrubbed, the upstream really did reflect the value
    plain = gzip.decompress(raw) if compressed else raw
    assert cred.value.encode() in plain and leaks(plain, cred.value)
    assert any(cred.value in v or quote(cred.value, safe="") in v for _, v in resp.headers.multi_items())
    for size in (1, 3, 16, 4096):
        run = scrubbing_stream(encoding, scrubber)
        out = b"".join(run(raw[i : i + size]) for i in range(0, len(raw), size)) + run(b"")
        assert not leaks(out, cred.value), size
        assert json.loads(out)["headers"]["Content-Type"] == "application/json"  # the rest is intact
    for _, v in headers:
        assert not leaks(v.encode(), cred.value)


async def test_kv_header_placement_reaches_upstream_once(broker: Broker) -> None:
    seen: list[list[str]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.headers.getall("Authorization", []))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", record)
    runner, base = await serve(app)
    try:
        cred = await broker.issue("openai", KV_CAP, "sbx-1", "api.openai.com", time.time())
        sent = [("authorization", "Bearer a"), ("Authorization", "Bearer b")]
        async with httpx.AsyncClient(trust_env=False) as client:
            await client.get(base, headers=inject(KV_CAP, cred, sent, []).headers)
    finally:
        await runner.cleanup()
    assert seen == [[f"Bearer {KV_SECRET}"]]
