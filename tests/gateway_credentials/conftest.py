"""Credential injection through the real gateway (`egressgate run`) against a real OpenBao.

World: loopback TLS upstreams (trustme) that record what they received and can *reflect* the
credential they got in every encoding the scrubber must catch; a test DNS server resolving the `.test`
names to 127.0.0.1; one OpenBao dev server (tests/broker/bao.py, provisioned like production) and one
gateway using it through AppRole. Tests stay independent by admitting a fresh sandbox each.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import ssl
import subprocess
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import trustme
import yaml
from aiohttp import web

from tests.broker.bao import BaoServer
from tests.broker.jwtcheck import TokenRejected, verify
from tests.gateway.conftest import EGRESSGATE, DnsServer, Hits, LoopThread, _read_line, stop_gateway

NAMES = ["api.test", "jwt.test", "phantom.test", "other.test", "basic.test", "query.test", "forbidden.test",
         "oidc.test"]
MAX_TTL = 120
TRANSPARENT_BUDGET = 20000  # cred-transparent: outbound bytes of one sandbox


def secret_of(request: web.Request) -> str:
    """The credential the gateway placed (Bearer, Basic password or api_key query parameter)."""
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[7:]
    if auth.startswith("Basic "):
        return base64.b64decode(auth[6:]).decode().partition(":")[2]
    return request.query.get("api_key", "")


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
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    streams: dict[int, list] = {}
    try:
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    streams[event.stream_id] = [(k.decode(), v.decode()) for k, v in event.headers]
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
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
            writer.write(conn.data_to_send())
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


@dataclass
class World:
    tmp: Path
    ca: trustme.CA
    https_port: int
    https2_port: int
    http_port: int
    hits: Hits
    canary: Hits
    canary_port: int
    h2_port: int
    dns: DnsServer
    dns_port: int
    loop: LoopThread
    jwks_url: dict


@pytest.fixture(scope="session")
def cworld(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("credworld")
    ca = trustme.CA()
    cert = ca.issue_cert(*NAMES)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    hits, canary, dns, loop, jwks_url = Hits(), Hits(), DnsServer(), LoopThread(), {"url": ""}

    servers: list = []

    async def start():
        runners, ports = [], []
        for tls in (ctx, ctx, None):
            runner = web.AppRunner(make_app(hits, jwks_url), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])
            runners.append(runner)
        # the canary: a forbidden address (127.0.0.2) a credential must never reach unless a policy allows it
        runner = web.AppRunner(make_app(canary, jwks_url), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.2", 0, ssl_context=ctx)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])
        runners.append(runner)
        h2ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(h2ctx)
        h2ctx.set_alpn_protocols(["h2"])
        h2_server = await asyncio.start_server(lambda r, w: serve_h2(r, w, hits), "127.0.0.1", 0, ssl=h2ctx)
        ports.append(h2_server.sockets[0].getsockname()[1])
        servers.append(h2_server)
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: dns, local_addr=("127.0.0.1", 0))
        return runners, ports, transport

    runners, ports, transport = loop.run(start())
    for name in NAMES:
        dns.records[name] = "127.0.0.1"
    dns.records["forbidden.test"] = "127.0.0.2"
    w = World(tmp=tmp, ca=ca, https_port=ports[0], https2_port=ports[1], http_port=ports[2], hits=hits,
              canary=canary, canary_port=ports[3], h2_port=ports[4],
              dns=dns, dns_port=transport.get_extra_info("sockname")[1], loop=loop, jwks_url=jwks_url)
    try:
        yield w
    finally:
        async def stop():
            for runner in runners:
                await runner.cleanup()
            for server in servers:
                server.close()
            transport.close()
        loop.run(stop())
        loop.stop()


# --------------------------------------------------------------------------------------- policies
KV = {"vault": {"path": "egressgate/openai", "field": "api_key"}}


def policies(w: World, *, kv_ttl: int = 300, file_secret: str | None = None) -> dict[str, dict]:
    https, https2, http = w.https_port, w.https2_port, w.http_port

    def doc(name: str, https_rules: list, caps: dict, http_rules: list | None = None,
            private: str = "127.0.0.1/32") -> dict:
        network: dict = {"allow_private": [private], "https": {"allow": https_rules}}
        if http_rules:
            network["http"] = {"allow": http_rules}
        return {"sandbox": {"name": name}, "network": network,
                "credentials": {"max_ttl_seconds": MAX_TTL, "capabilities": caps}}

    def budgeted(d: dict, outbound_bytes_max: int) -> dict:
        d["sandbox"]["resources"] = {"outbound_bytes_max": outbound_bytes_max}
        return d

    source = {"file": file_secret} if file_secret else KV  # local backend: a 0600 file
    oidc_rules, oidc_caps = [], {}
    if not file_secret:  # vault_oidc needs the vault backend
        oidc_rules = [{"id": "oidc", "host": "oidc.test", "ports": [https], "methods": ["GET"], "paths": ["/echo"],
                       "credential": "internal"}]
        oidc_caps = {"internal": {"type": "vault_oidc", "role": "sbx-api"}}
    kv_cap = {"type": "static", "source": source, "ttl_seconds": kv_ttl}
    return {
        "cred-kv": doc("cred-kv", [
            {"id": "api-cred", "host": "api.test", "ports": [https], "methods": ["GET", "POST", "HEAD"],
             "paths": ["/echo", "/reflect/*", "/redirect", "/stream"], "credential": "kv"},
            {"id": "api-any", "host": "api.test", "ports": [https], "paths": ["/any/**"], "credential": "kv"},
            {"id": "api-put", "host": "api.test", "ports": [https], "methods": ["PUT"], "paths": ["/echo"]},
            {"id": "api-open", "host": "api.test", "ports": [https], "methods": ["GET"], "paths": ["/open/**"]},
            {"id": "api-port2", "host": "api.test", "ports": [https2]},
            {"id": "api-h2", "host": "api.test", "ports": [w.h2_port], "methods": ["GET"], "paths": ["/h2/*"],
             "credential": "kv"},
            {"id": "other", "host": "other.test", "ports": [https]},
            {"id": "basic", "host": "basic.test", "ports": [https], "credential": "kvbasic"},
            {"id": "query", "host": "query.test", "ports": [https], "credential": "kvquery"},
            {"id": "forbidden", "host": "forbidden.test", "ports": [w.canary_port], "credential": "kv"},
            {"id": "ws", "host": "other.test", "ports": [https2], "credential": "kv"},
        ], {"kv": kv_cap,
            "kvbasic": {**kv_cap, "placement": {"basic": {"username": "x-access-token"}}},
            "kvquery": {**kv_cap, "placement": {"query": "api_key"}}},
            http_rules=[{"id": "plain", "host": "api.test", "ports": [http]}]),
        # positive control for the canary: the same credentialed rule where 127.0.0.2 is permitted
        "cred-canary-open": doc("cred-canary-open", [
            {"id": "forbidden", "host": "forbidden.test", "ports": [w.canary_port], "credential": "kv"},
        ], {"kv": kv_cap}, private="127.0.0.0/8"),
        # a phantom_env that would override the proxy variables: admission must refuse it
        "cred-clash": doc("cred-clash", [
            {"id": "openai", "host": "phantom.test", "ports": [https], "credential": "openai"},
        ], {"openai": {**kv_cap, "mode": "phantom", "phantom_env": "HTTPS_PROXY"}}),
        # test_transparent.py: credentialed, phantom and plain routes under one byte budget, used over the
        # transparent listener and the explicit proxy by the same sandbox
        "cred-transparent": budgeted(doc("cred-transparent", [
            {"id": "api-cred", "host": "api.test", "ports": [https], "methods": ["GET", "POST"],
             "paths": ["/echo", "/reflect/*"], "credential": "kv"},
            {"id": "api-open", "host": "api.test", "ports": [https], "methods": ["POST"], "paths": ["/open/**"]},
            {"id": "api-quota", "host": "api.test", "ports": [https], "methods": ["GET"], "paths": ["/quota/**"],
             "budget": {"requests": 2}},
            {"id": "api-qbytes", "host": "api.test", "ports": [https], "methods": ["POST"], "paths": ["/qbytes/**"],
             "budget": {"bytes": 3000}},
            {"id": "openai", "host": "phantom.test", "ports": [https], "methods": ["GET", "POST"],
             "paths": ["/v1/**"], "credential": "openai"},
            {"id": "other", "host": "other.test", "ports": [https]},
            {"id": "ws", "host": "other.test", "ports": [https2], "credential": "kv"},
            {"id": "api-h2", "host": "api.test", "ports": [w.h2_port], "methods": ["GET"], "paths": ["/h2/*"],
             "credential": "kv"},
        ], {"kv": kv_cap,
            "openai": {**kv_cap, "mode": "phantom", "phantom_env": "OPENAI_API_KEY",
                       "placement": {"header": "Authorization", "format": "Bearer {value}"}}},
            http_rules=[{"id": "plain", "host": "api.test", "ports": [http]}]),
            TRANSPARENT_BUDGET),
        "cred-jwt": doc("cred-jwt", [
            {"id": "jwt", "host": "jwt.test", "ports": [https], "methods": ["GET"], "paths": ["/jwt", "/reflect/*"],
             "credential": "billing"},
            *oidc_rules,
        ], {"billing": {"type": "jwt", "ttl_seconds": 600}, **oidc_caps}),
        "cred-phantom": doc("cred-phantom", [
            {"id": "openai", "host": "phantom.test", "ports": [https], "methods": ["GET", "POST"],
             "paths": ["/v1/**", "/reflect/*"], "credential": "openai"},
            {"id": "phantom-open", "host": "phantom.test", "ports": [https], "methods": ["GET"], "paths": ["/open"]},
            {"id": "other", "host": "other.test", "ports": [https]},
        ], {"openai": {**kv_cap, "mode": "phantom", "phantom_env": "OPENAI_API_KEY",
                       "placement": {"header": "Authorization", "format": "Bearer {value}"}}}),
    }


# --------------------------------------------------------------------------------------- gateway
@dataclass
class Gateway:
    proc: subprocess.Popen
    var: Path
    proxy: tuple[str, int]
    admin: str
    token: str
    world: World
    stderr_path: Path

    @property
    def bundle(self) -> str:
        return str(self.var / "ca" / "sandbox-ca-bundle.pem")

    def admit(self, policy: str) -> dict:
        res = httpx.post(f"http://{self.admin}/v1/sandboxes", json={"policy": policy},
                         headers={"Authorization": f"Bearer {self.token}"}, timeout=10, trust_env=False)
        assert res.status_code == 201, res.text
        return res.json()

    def client(self, sbx: dict, **kw) -> httpx.Client:
        return httpx.Client(proxy=sbx["proxy_url"], verify=ssl.create_default_context(cafile=self.bundle),
                            timeout=15, trust_env=False, **kw)

    def url(self, host: str, path: str, port: int | None = None, scheme: str = "https") -> str:
        port = port or (self.world.https_port if scheme == "https" else self.world.http_port)
        return f"{scheme}://{host}:{port}{path}"

    def audit_text(self) -> str:
        return (self.var / "audit.jsonl").read_text()

    def audit_records(self) -> list[dict]:
        out = []
        for line in self.audit_text().splitlines():
            if line.strip():
                rec = json.loads(line)["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]
                out.append({kv["key"]: next(iter(kv["value"].values())) if kv["value"] else None
                            for kv in rec["attributes"]})
        return out

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def launch(w: World, tmp: Path, bao: BaoServer | None, *, kv_ttl: int = 300, broker: dict | None = None,
           file_secret: str | None = None, audit: dict | None = None) -> Gateway:
    policy_dir = tmp / "policies"
    policy_dir.mkdir(exist_ok=True)
    for name, doc in policies(w, kv_ttl=kv_ttl, file_secret=file_secret).items():
        (policy_dir / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    var = tmp / "var"
    ca_bundle = tmp / "upstream-ca.pem"
    ca_bundle.write_bytes(w.ca.cert_pem.bytes())
    if broker is None:
        assert bao is not None
        broker = {"backend": "vault", "vault_addr": bao.addr, "auth": "approle", "role_id": bao.role_id,
                  "secret_id": bao.secret_id, "timeout_seconds": 2}
    config = {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": "127.0.0.2:0"},
        "policy": str(policy_dir), "var_dir": str(var),
        "upstream": {"resolver": f"127.0.0.1:{w.dns_port}", "ca_bundle": str(ca_bundle)},
    }
    if broker:
        config["broker"] = broker
    if audit:
        config["audit"] = audit
    cfg = tmp / "gateway.yaml"
    cfg.write_text(yaml.safe_dump(config))
    os.chmod(cfg, 0o600)
    stderr_path = tmp / "gateway.stderr"
    stderr = open(stderr_path, "w")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen([EGRESSGATE, "run", "--config", str(cfg), "--log-level", "DEBUG"],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, "NO_PROXY": ""})
    line = _read_line(proc, 30)
    try:
        info = json.loads(line)
    except ValueError as exc:
        proc.kill()
        raise RuntimeError(f"gateway did not start: {line!r}\n{stderr_path.read_text()[-3000:]}") from exc
    host, _, port = info["proxy"].rpartition(":")
    return Gateway(proc=proc, var=var, proxy=(host, int(port)), admin=info["admin"],
                   token=(var / "admin.token").read_text().strip(), world=w, stderr_path=stderr_path)


@pytest.fixture(scope="session")
def cbao() -> Iterator[BaoServer]:
    server = BaoServer().start()
    try:
        server.configure()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def cgw(cworld: World, cbao: BaoServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = launch(cworld, tmp_path_factory.mktemp("credgw"), cbao)
    cworld.jwks_url["url"] = f"http://{gw.admin}/.well-known/jwks.json"
    try:
        yield gw
    finally:
        stop_gateway(gw)  # type: ignore[arg-type]  # same .proc contract
