"""The broker against a real OpenBao: KV, transit-signed JWTs, identity OIDC, AppRole, fail-closed."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
import urllib.request
from collections.abc import AsyncIterator

import hvac
import pytest

from egressgate.broker.broker import Broker
from egressgate.broker.credential import CredentialUnavailable
from egressgate.broker.vault import VaultBackend
from tests.support import jwtcheck
from tests.support.bao import CAP, JWT_CAP, KV_CAP, KV_SECRET, OIDC_CAP, BaoServer, vault_config


@pytest.fixture
async def broker(bao: BaoServer) -> AsyncIterator[Broker]:
    b = Broker.from_config(vault_config(bao))
    await b.start()
    yield b
    await b.aclose()


def count_http(backend: VaultBackend) -> list[str]:
    """Record every HTTP request hvac really sends (independent of the backend's own counter)."""
    seen: list[str] = []
    session = backend.client.adapter.session
    original = session.request

    def request(method, url, *a, **kw):
        seen.append(f"{method.upper()} {url.split('/v1/', 1)[-1]}")
        return original(method, url, *a, **kw)

    session.request = request
    return seen


async def test_kv_static_secret(broker: Broker) -> None:
    now = time.time()
    cred = await broker.issue("openai", KV_CAP, "sbx-1", "api.openai.com", now)
    assert cred.value == KV_SECRET
    assert cred.key_id == "kv:secret/egressgate/openai#api_key@v1"
    assert cred.expires_at == pytest.approx(now + 300)
    assert KV_SECRET not in repr(cred) and KV_SECRET not in str(cred) and KV_SECRET not in f"{cred}"


async def test_missing_field_is_unavailable(broker: Broker) -> None:
    cap = CAP.validate_python({"type": "static", "source": {"vault": {"path": "egressgate/openai", "field": "nope"}}})
    with pytest.raises(CredentialUnavailable, match="field 'nope' missing"):
        await broker.issue("x", cap, "sbx-1", "h", time.time())


async def test_transit_jwt_verifies_with_jwks(bao: BaoServer, broker: Broker) -> None:
    now = time.time()
    cred = await broker.issue("svc", JWT_CAP, "sbx-42", "api.example.test", now)
    jwks = await broker.jwks()
    claims = jwtcheck.verify(cred.value, jwks, audience="api.example.test", now=now)
    assert claims["sub"] == "sbx-42" and claims["iss"] == "egressgate"
    assert claims["exp"] - claims["iat"] == 120 and claims["jti"]
    assert cred.key_id == jwks["keys"][0]["kid"] and cred.expires_at == claims["exp"]
    # the JWKS is exactly Vault's transit public key (read independently with the root token)
    pub = bao.root().secrets.transit.read_key("egressgate-jwt")["data"]["keys"]["1"]["public_key"]
    assert base64.urlsafe_b64decode(jwks["keys"][0]["x"] + "==") == base64.b64decode(pub)
    # the upstream rejects: wrong audience, tampered claims, expiry
    with pytest.raises(jwtcheck.TokenRejected, match="aud"):
        jwtcheck.verify(cred.value, jwks, audience="other.example.test", now=now)
    h, p, s = cred.value.split(".")
    forged = json.loads(base64.urlsafe_b64decode(p + "=="))
    forged["sub"] = "sbx-admin"
    p2 = base64.urlsafe_b64encode(json.dumps(forged).encode()).rstrip(b"=").decode()
    with pytest.raises(jwtcheck.TokenRejected, match="signature"):
        jwtcheck.verify(f"{h}.{p2}.{s}", jwks, audience="api.example.test", now=now)
    with pytest.raises(jwtcheck.TokenRejected, match="expired"):
        jwtcheck.verify(cred.value, jwks, audience="api.example.test", now=now + 121)


async def test_jwt_ttl_clamped_and_configured_audience(broker: Broker) -> None:
    cap = CAP.validate_python({"type": "jwt", "ttl_seconds": 3600, "audience": "billing-api"})
    now = time.time()
    cred = await broker.issue("b", cap, "sbx-1", "billing.example.test", now, max_ttl_seconds=300)
    claims = jwtcheck.verify(cred.value, await broker.jwks(), audience="billing-api", now=now)
    assert claims["exp"] - claims["iat"] == 300


async def test_oidc_role_token(bao: BaoServer, broker: Broker) -> None:
    now = time.time()
    cred = await broker.issue("oidc", OIDC_CAP, "sbx-1", "ignored.example.test", now)
    with urllib.request.urlopen(f"{bao.addr}/v1/identity/oidc/.well-known/keys", timeout=5) as r:  # noqa: S310
        vault_jwks = json.load(r)
    claims = jwtcheck.verify(cred.value, vault_jwks, audience=bao.oidc_client_id, now=now)
    assert claims["sub"]  # the AppRole login's entity (a root token would have none)
    assert claims["exp"] - claims["iat"] == 120
    long_cap = CAP.validate_python({"type": "vault_oidc", "role": "sbx-long"})
    with pytest.raises(CredentialUnavailable, match="exceeds max_ttl_seconds"):
        await broker.issue("oidc-long", long_cap, "sbx-1", "h", now, max_ttl_seconds=300)


async def test_single_flight_and_cache(broker: Broker) -> None:
    backend = broker.backend
    assert isinstance(backend, VaultBackend)
    now = time.time()
    await broker.issue("svc", JWT_CAP, "warm", "a.example.test", now)  # loads the transit key info
    http = count_http(backend)
    calls0 = backend.calls
    creds = await asyncio.gather(*(broker.issue("svc", JWT_CAP, "sbx-b", "a.example.test", now) for _ in range(25)))
    assert len({id(c) for c in creds}) == 1
    assert backend.calls - calls0 == 1 and http == ["POST transit/sign/egressgate-jwt"]
    # reused until 80 % of the lifetime, minted again after
    assert await broker.issue("svc", JWT_CAP, "sbx-b", "a.example.test", now + 0.79 * 120) is creds[0]
    assert len(http) == 1
    fresh = await broker.issue("svc", JWT_CAP, "sbx-b", "a.example.test", now + 0.81 * 120)
    assert fresh is not creds[0] and len(http) == 2
    # per sandbox and per audience
    await broker.issue("svc", JWT_CAP, "sbx-c", "a.example.test", now)
    await broker.issue("svc", JWT_CAP, "sbx-b", "b.example.test", now)
    assert len(http) == 4
    # KV: a burst is one read
    kv = await asyncio.gather(*(broker.issue("openai", KV_CAP, "sbx-b", "h", now) for _ in range(10)))
    assert len({id(c) for c in kv}) == 1 and len(http) == 5 and http[-1].startswith("GET secret/data/")


async def test_approle_token_is_renewed(bao: BaoServer) -> None:
    role_id, secret_id = bao.approle("gw-short", token_ttl="2s", token_max_ttl="60s")
    b = Broker.from_config(vault_config(bao, role_id=role_id, secret_id=secret_id, renew_fraction=0.5))
    await b.start()
    try:
        backend = b.backend
        assert isinstance(backend, VaultBackend)
        token = backend.client.token
        await asyncio.sleep(3.5)  # well past the original 2 s TTL
        assert backend.renewals >= 2 and backend.logins == 1
        assert (await b.issue("openai", KV_CAP, "s", "h", time.time())).value == KV_SECRET
        assert backend.logins == 1 and backend.client.token == token  # same token, kept alive
    finally:
        await b.aclose()


async def test_approle_relogin_at_max_ttl(bao: BaoServer) -> None:
    role_id, secret_id = bao.approle("gw-capped", token_ttl="2s", token_max_ttl="3s")
    b = Broker.from_config(vault_config(bao, role_id=role_id, secret_id=secret_id, renew_fraction=0.5))
    await b.start()
    try:
        await asyncio.sleep(4.0)
        backend = b.backend
        assert isinstance(backend, VaultBackend)
        assert backend.logins >= 2
        assert (await b.issue("openai", KV_CAP, "s", "h", time.time())).value == KV_SECRET
    finally:
        await b.aclose()


async def test_relogin_once_on_403(bao: BaoServer, broker: Broker) -> None:
    backend = broker.backend
    assert isinstance(backend, VaultBackend)
    bao.root().auth.token.revoke(backend.client.token)
    cred = await broker.issue("openai", KV_CAP, "sbx-1", "h", time.time())
    assert cred.value == KV_SECRET and backend.logins == 2


async def test_denied_after_relogin_fails_closed(broker: Broker) -> None:
    backend = broker.backend
    assert isinstance(backend, VaultBackend)
    outside = CAP.validate_python(
        {"type": "static", "source": {"vault": {"path": "outside/other", "field": "api_key"}}}
    )
    with pytest.raises(CredentialUnavailable, match="denied"):
        await broker.issue("outside", outside, "sbx-1", "h", time.time())
    assert backend.logins == 2  # exactly one re-login, then give up


async def test_token_auth_from_private_file(bao: BaoServer, tmp_path) -> None:
    token = bao.root().auth.token.create(policies=["egressgate-gw"], ttl="1h")["auth"]["client_token"]
    path = tmp_path / "token"
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    b = Broker.from_config(vault_config(bao, auth="token", token_file=str(path), role_id=None, secret_id=None))
    await b.start()
    try:
        assert (await b.issue("openai", KV_CAP, "s", "h", time.time())).value == KV_SECRET
    finally:
        await b.aclose()
    os.chmod(path, 0o644)
    exposed = Broker.from_config(vault_config(bao, auth="token", token_file=str(path)))
    with pytest.raises(CredentialUnavailable, match="group/other"):
        await exposed.start()


async def test_approle_credentials_from_gateway_env(bao: BaoServer) -> None:
    cfg = vault_config(bao, role_id=None, secret_id=None)
    backend = VaultBackend(
        cfg, env={"EGRESSGATE_VAULT_ROLE_ID": bao.role_id, "EGRESSGATE_VAULT_SECRET_ID": bao.secret_id}
    )
    b = Broker(backend)
    await b.start()
    try:
        assert (await b.issue("openai", KV_CAP, "s", "h", time.time())).value == KV_SECRET
    finally:
        await b.aclose()
    with pytest.raises(CredentialUnavailable, match="role_id and secret_id"):
        await Broker(VaultBackend(cfg, env={})).start()
    wrong = Broker.from_config(vault_config(bao, secret_id="not-the-secret-id"))
    with pytest.raises(CredentialUnavailable, match="login failed"):
        await wrong.start()


async def test_vault_stopped_mid_test(make_bao) -> None:
    server = make_bao()
    b = Broker.from_config(vault_config(server, timeout_seconds=2.0))
    await b.start()
    try:
        now = time.time()
        kept = await b.issue("svc", JWT_CAP, "sbx-1", "a.example.test", now)
        server.stop()
        t0 = time.monotonic()
        for cap, name in ((JWT_CAP, "svc"), (KV_CAP, "openai")):
            with pytest.raises(CredentialUnavailable, match="unreachable"):
                await b.issue(name, cap, "sbx-2", "a.example.test", now)
        assert time.monotonic() - t0 < 5
        # a credential minted before the outage stays usable until its reuse window ends, then fails
        assert await b.issue("svc", JWT_CAP, "sbx-1", "a.example.test", now + 10) is kept
        with pytest.raises(CredentialUnavailable):
            await b.issue("svc", JWT_CAP, "sbx-1", "a.example.test", now + 0.81 * 120)
    finally:
        await b.aclose()
    with pytest.raises(CredentialUnavailable, match="unreachable"):
        await Broker.from_config(vault_config(server, timeout_seconds=2.0)).start()


async def test_no_secret_in_logs(bao: BaoServer, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    b = Broker.from_config(vault_config(bao))
    await b.start()
    try:
        kv = await b.issue("openai", KV_CAP, "s", "h", time.time())
        jwt = await b.issue("svc", JWT_CAP, "s", "h", time.time())
        logging.getLogger("egressgate.test").info("issued %s %r", kv, jwt)
    finally:
        await b.aclose()
    assert caplog.records  # logging really was captured
    for secret in (KV_SECRET, jwt.value, bao.secret_id):
        assert secret not in caplog.text


def test_hvac_client_ignores_proxy_env(bao: BaoServer) -> None:
    backend = VaultBackend(vault_config(bao))
    assert backend.client.adapter.session.trust_env is False
    assert isinstance(backend.client, hvac.Client)


async def test_transit_rotation_keeps_old_tokens_verifiable(make_bao) -> None:
    server = make_bao()  # private: rotating the shared key would disturb other tests
    b = Broker.from_config(vault_config(server))
    await b.start()
    try:
        backend = b.backend
        assert isinstance(backend, VaultBackend)
        now = time.time()
        old = await b.issue("svc", JWT_CAP, "sbx-1", "a.example.test", now)
        server.root().secrets.transit.rotate_key("egressgate-jwt")
        backend.key_info_ttl = 0  # re-read the key's versions now instead of within 60 s
        new = await b.issue("svc", JWT_CAP, "sbx-2", "a.example.test", now)
        assert new.key_id != old.key_id
        jwks = await b.jwks()
        assert {k["kid"] for k in jwks["keys"]} == {old.key_id, new.key_id}
        for cred in (old, new):
            jwtcheck.verify(cred.value, jwks, audience="a.example.test", now=now)
    finally:
        await b.aclose()
