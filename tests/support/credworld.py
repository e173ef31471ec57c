"""Credential injection through the real gateway (`egressgate run`) against a real OpenBao.

World: loopback TLS upstreams (trustme, tests/support/reflect.py) that record what they received and can
*reflect* the credential they got in every encoding the scrubber must catch; a test DNS server resolving
the `.test` names to 127.0.0.1; one OpenBao dev server (tests/support/bao.py, provisioned like production)
and one gateway using it through AppRole (fixtures in tests/gateway_credentials/conftest.py). Tests stay
independent by admitting a fresh sandbox each.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import trustme

from tests.support.bao import BaoServer
from tests.support.launcher import LoopbackGateway, launch_loopback, write_policies
from tests.support.loopback import DnsServer, Hits, LoopThread, serve_app, server_context, start_dns
from tests.support.reflect import make_app, serve_h2

NAMES = ["api.test", "jwt.test", "phantom.test", "other.test", "basic.test", "query.test", "forbidden.test",
         "oidc.test"]
MAX_TTL = 120
TRANSPARENT_BUDGET = 20000  # cred-transparent: outbound bytes of one sandbox


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


@contextlib.contextmanager
def open_world(tmp: Path) -> Iterator[World]:
    """Start the reflecting upstreams, the canary, the h2 upstream and the DNS server on loopback."""
    ca = trustme.CA()
    cert = ca.issue_cert(*NAMES)
    ctx = server_context(cert)
    hits, canary, dns, loop, jwks_url = Hits(), Hits(), DnsServer(), LoopThread(), {"url": ""}

    servers: list = []

    async def start():
        runners, ports = [], []
        for tls in (ctx, ctx, None):
            runner, port = await serve_app(make_app(hits, jwks_url), "127.0.0.1", tls)
            ports.append(port)
            runners.append(runner)
        # the canary: a forbidden address (127.0.0.2) a credential must never reach unless a policy allows it
        runner, port = await serve_app(make_app(canary, jwks_url), "127.0.0.2", ctx)
        ports.append(port)
        runners.append(runner)
        h2ctx = server_context(cert, ["h2"])
        h2_server = await asyncio.start_server(lambda r, w: serve_h2(r, w, hits), "127.0.0.1", 0, ssl=h2ctx)
        ports.append(h2_server.sockets[0].getsockname()[1])
        servers.append(h2_server)
        transport, dns_port = await start_dns(dns)
        return runners, ports, transport, dns_port

    runners, ports, transport, dns_port = loop.run(start())
    for name in NAMES:
        dns.records[name] = "127.0.0.1"
    dns.records["forbidden.test"] = "127.0.0.2"
    w = World(tmp=tmp, ca=ca, https_port=ports[0], https2_port=ports[1], http_port=ports[2], hits=hits,
              canary=canary, canary_port=ports[3], h2_port=ports[4],
              dns=dns, dns_port=dns_port, loop=loop, jwks_url=jwks_url)
    try:
        yield w
    finally:
        loop.close(runners, servers, [transport])


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
class Gateway(LoopbackGateway):
    world: World

    def admit(self, policy: str) -> dict:
        return self.admit_sandbox({"policy": policy})

    def client(self, sbx: dict, **kw) -> httpx.Client:
        return self.proxied_client(sbx["proxy_url"], **kw)

    def url(self, host: str, path: str, port: int | None = None, scheme: str = "https") -> str:
        port = port or (self.world.https_port if scheme == "https" else self.world.http_port)
        return f"{scheme}://{host}:{port}{path}"


def launch(w: World, tmp: Path, bao: BaoServer | None, *, kv_ttl: int = 300, broker: dict | None = None,
           file_secret: str | None = None, audit: dict | None = None) -> Gateway:
    """A gateway with every policy of `policies(w)`; broker = `bao` through AppRole unless `broker` says
    otherwise (`{}`: no broker section at all)."""
    policy_dir = write_policies(tmp / "policies", policies(w, kv_ttl=kv_ttl, file_secret=file_secret))
    ca_bundle = tmp / "upstream-ca.pem"
    ca_bundle.write_bytes(w.ca.cert_pem.bytes())
    if broker is None:
        assert bao is not None
        broker = {"backend": "vault", "vault_addr": bao.addr, "auth": "approle", "role_id": bao.role_id,
                  "secret_id": bao.secret_id, "timeout_seconds": 2}
    config = {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": "127.0.0.2:0"},
        "policy": str(policy_dir), "var_dir": str(tmp / "var"),
        "upstream": {"resolver": f"127.0.0.1:{w.dns_port}", "ca_bundle": str(ca_bundle)},
    }
    if broker:
        config["broker"] = broker
    if audit:
        config["audit"] = audit
    return Gateway(**launch_loopback(tmp, config, private=True), world=w)  # 0600: broker secrets


def hits_for(gw: Gateway, mark: int, host: str) -> list[dict]:
    """What the upstreams recorded for `host` since `mark`."""
    return [h for h in gw.world.hits.since(mark) if (h["host"] or "").split(":")[0] == host]


def last(gw: Gateway, mark: int, host: str) -> dict:
    """The last request `host` received since `mark` (asserts there was one)."""
    got = hits_for(gw, mark, host)
    assert got, f"upstream {host} was not reached"
    return got[-1]
