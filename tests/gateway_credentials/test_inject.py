"""Injection through the real gateway: where a credential goes, and where it never goes.

Every "never" test has its positive control in the same test: the same sandbox and route shape with
the credentialed rule does receive the secret, so a test cannot pass because injection is broken.
"""

from __future__ import annotations

import base64
import time

import httpx

from tests.support.bao import KV_SECRET
from tests.support.credworld import MAX_TTL, Gateway, hits_for, last


def carries_secret(hit: dict) -> bool:
    blob = repr(hit["headers"]) + hit["query"] + hit["body"].decode("latin-1")
    return KV_SECRET in blob or base64.b64encode(f"x-access-token:{KV_SECRET}".encode()).decode() in blob


def test_kv_static_injected_and_sandbox_authorization_replaced(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        r = c.get(cgw.url("api.test", "/echo"),
                  headers=[("Authorization", "Bearer sandbox-own"), ("authorization", "Basic c2FuZDpib3g="),
                           ("Accept-Encoding", "gzip, br")])
    assert r.status_code == 200, r.text
    hit = last(cgw, mark, "api.test")
    assert hit["auth"] == [f"Bearer {KV_SECRET}"]  # exactly one; the sandbox's own values are gone
    assert dict(hit["headers"])["accept-encoding"] == "identity"
    assert KV_SECRET not in r.text


def test_basic_and_query_placements(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        assert c.get(cgw.url("basic.test", "/echo"), headers={"Authorization": "Basic Zm9vOmJhcg=="}).status_code == 200
        assert c.get(cgw.url("query.test", "/echo?api_key=mine&API_KEY=x&q=1")).status_code == 200
    basic = last(cgw, mark, "basic.test")
    assert basic["auth"] == ["Basic " + base64.b64encode(f"x-access-token:{KV_SECRET}".encode()).decode()]
    query = last(cgw, mark, "query.test")
    assert query["auth"] == []
    pairs = [p.split("=", 1) for p in query["query"].split("&")]
    assert [v for k, v in pairs if k.lower() == "api_key"] == [KV_SECRET]  # one, replacing both of ours
    assert ["q", "1"] in pairs


def test_no_injection_on_plain_http_other_method_path_or_port(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    w = cgw.world
    with cgw.client(sbx) as c:
        mark = w.hits.mark()
        assert c.get(cgw.url("api.test", "/echo")).status_code == 200  # positive control
        assert carries_secret(last(cgw, mark, "api.test"))
        cases = [
            ("GET", cgw.url("api.test", "/echo", scheme="http")),  # plain HTTP, same host and path
            ("PUT", cgw.url("api.test", "/echo")),  # other method, allowed by a rule without credential
            ("GET", cgw.url("api.test", "/open/x")),  # other path
            ("GET", cgw.url("api.test", "/echo", port=w.https2_port)),  # other port
        ]
        for method, url in cases:
            mark = w.hits.mark()
            r = c.request(method, url, headers={"Authorization": "Bearer sandbox-own"})
            assert r.status_code == 200, (method, url, r.text)
            hit = last(cgw, mark, "api.test")
            assert not carries_secret(hit), (method, url)
            assert hit["auth"] == ["Bearer sandbox-own"], (method, url)  # untouched off the credential route


def test_no_credential_after_redirect(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    w = cgw.world
    target = cgw.url("other.test", "/echo")
    with cgw.client(sbx, follow_redirects=True) as c:
        mark = w.hits.mark()
        r = c.get(cgw.url("api.test", f"/redirect?to={target}"))
    assert r.status_code == 200 and len(r.history) == 1, r.text
    assert carries_secret(last(cgw, mark, "api.test"))  # the credentialed hop had it
    assert not carries_secret(last(cgw, mark, "other.test"))  # the Location host never gets it
    # a Location that carries the secret itself is scrubbed before the sandbox sees it
    with cgw.client(sbx) as c:
        r = c.get(cgw.url("api.test", "/reflect/redirect"))
    assert r.status_code == 302
    assert KV_SECRET not in r.headers["location"] and "REDACTED" in r.headers["location"]


def test_trace_refused_on_credentialed_route(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    w = cgw.world
    with cgw.client(sbx) as c:
        mark = w.hits.mark()
        assert c.get(cgw.url("api.test", "/any/x")).status_code == 200  # the rule allows any method
        assert carries_secret(last(cgw, mark, "api.test"))
        mark = w.hits.mark()
        r = c.request("TRACE", cgw.url("api.test", "/any/x"))
    assert r.status_code == 403
    assert r.json()["reason"] == "method_not_allowed" and r.json()["rule"] == "api-any"
    assert hits_for(cgw, mark, "api.test") == []


def test_jwt_verified_by_upstream_with_admin_jwks(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-jwt")
    with cgw.client(sbx) as c:
        r = c.get(cgw.url("jwt.test", "/jwt"), headers={"Authorization": "Bearer forged"})
    assert r.status_code == 200, r.text
    claims = r.json()
    now = time.time()
    assert claims["sub"] == sbx["id"] and claims["aud"] == "jwt.test" and claims["iss"] == "egressgate"
    assert now - 30 < claims["iat"] <= now + 1
    assert claims["exp"] - claims["iat"] == MAX_TTL  # ttl_seconds 600 clamped to max_ttl_seconds
    # another sandbox gets its own token (sub), and the upstream rejects a token for another audience
    other = cgw.admit("cred-jwt")
    with cgw.client(other) as c:
        assert c.get(cgw.url("jwt.test", "/jwt")).json()["sub"] == other["id"]


def test_jwks_endpoint_public_and_safe(cgw: Gateway) -> None:
    url = f"http://{cgw.admin}/.well-known/jwks.json"
    r = httpx.get(url, trust_env=False, timeout=5)  # no admin token needed
    assert r.status_code == 200
    keys = r.json()["keys"]
    assert keys and all(set(k) <= {"kty", "crv", "x", "kid", "alg", "use"} for k in keys)
    assert all(k["kty"] == "OKP" and k["crv"] == "Ed25519" and k["alg"] == "EdDSA" for k in keys)
    # only GET is unauthenticated; the rest of the admin API still needs the token
    assert httpx.post(url, trust_env=False, timeout=5).status_code == 401
    assert httpx.post(f"http://{cgw.admin}/v1/sandboxes", json={"policy": "cred-kv"}, trust_env=False,
                      timeout=5).status_code == 401


def test_audit_carries_capability_and_key_id_only(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    with cgw.client(sbx) as c:
        for _ in range(3):
            assert c.get(cgw.url("api.test", "/echo")).status_code == 200
    records = [r for r in cgw.audit_records() if r.get("egressgate.sandbox.id") == sbx["id"]]
    issues = [r for r in records if r.get("egressgate.operation") == "credential_issue"]
    assert len(issues) == 1  # one mint, reused from the broker cache for the next two
    assert issues[0]["egressgate.capability"] == "kv"
    assert issues[0]["egressgate.key_id"].startswith("kv:secret/egressgate/openai#api_key@v")
    decisions = [r for r in records if r.get("egressgate.operation") == "http_request"]
    assert len(decisions) == 3
    assert all(r["egressgate.capability"] == "kv" and r["egressgate.key_id"] == issues[0]["egressgate.key_id"]
               for r in decisions)
    assert KV_SECRET not in cgw.audit_text()


def test_vault_oidc_token_injected(cgw: Gateway) -> None:
    """A Vault identity OIDC token (role sbx-api, ttl 120 <= max_ttl_seconds): aud is the role's client_id."""
    import json

    sbx = cgw.admit("cred-jwt")
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        assert c.get(cgw.url("oidc.test", "/echo")).status_code == 200
    (auth,) = last(cgw, mark, "oidc.test")["auth"]
    assert auth.startswith("Bearer ey")
    payload = auth[7:].split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["exp"] - claims["iat"] <= MAX_TTL and claims["exp"] > time.time()
    assert isinstance(claims["aud"], str) and claims["aud"]
