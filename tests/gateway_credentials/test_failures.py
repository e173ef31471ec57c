"""Fail closed, and nothing leaks: Vault stopped mid-test, the local backend as the embedded default,
and no secret in the gateway's logs, its error pages, the audit file or the admission output."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.bao import KV_SECRET, BaoServer
from tests.support.credworld import Gateway, World, last, launch
from tests.support.replay_check import stop_and_replay


@pytest.fixture
def private_bao() -> Iterator[BaoServer]:
    server = BaoServer().start().configure()
    try:
        yield server
    finally:
        server.stop()


def test_vault_stopped_mid_test_denies_credential_unavailable(
    cworld: World, private_bao: BaoServer, tmp_path
) -> None:
    gw = launch(cworld, tmp_path, private_bao, kv_ttl=1)  # a cached secret is reused for < 1 s only
    try:
        sbx = gw.admit("cred-kv")
        mark = cworld.hits.mark()
        with gw.client(sbx) as c:
            assert c.get(gw.url("api.test", "/echo")).status_code == 200  # positive control
            assert last(gw, mark, "api.test")["auth"] == [f"Bearer {KV_SECRET}"]
            private_bao.stop()
            time.sleep(1.1)
            mark = cworld.hits.mark()
            r = c.get(gw.url("api.test", "/echo"))
            assert r.status_code == 403, r.text
            assert r.json()["reason"] == "credential_unavailable" and r.json()["rule"] == "api-cred"
            assert cworld.hits.since(mark) == []  # nothing was sent without its credential
            assert c.get(gw.url("api.test", "/echo", port=cworld.https2_port)).status_code == 200  # others work
        records = [r for r in gw.audit_records() if r.get("egressgate.reason") == "credential_unavailable"]
        assert records and records[-1]["egressgate.capability"] == "kv"
        for text in (r.text, gw.audit_text(), gw.stderr()):
            assert KV_SECRET not in text
    finally:
        stop_and_replay(gw)  # type: ignore[arg-type]


def test_no_secret_in_logs_error_pages_or_admission(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-phantom")
    phantom = sbx["env"]["OPENAI_API_KEY"]
    kv = cgw.admit("cred-kv")
    with cgw.client(sbx) as c:
        c.post(cgw.url("phantom.test", "/v1/x"), headers={"Authorization": f"Bearer {phantom}"}, content=b"{}")
        deny = c.get(cgw.url("other.test", "/echo"), headers={"Authorization": f"Bearer {phantom}"})
    with cgw.client(kv) as c:
        c.get(cgw.url("api.test", "/reflect/plain"))
        refused = c.get(cgw.url("api.test", "/reflect/compress"))
        trace = c.request("TRACE", cgw.url("api.test", "/any/x"))
    assert (deny.status_code, refused.status_code, trace.status_code) == (403, 502, 403), (deny.text, refused.text)
    time.sleep(0.2)

    def around(text: str, needle: str) -> str:
        i = text.find(needle)
        return text[max(0, i - 300): i + 100]

    for name, text in {"deny page": deny.text, "502 page": refused.text, "trace page": trace.text,
                       "admission": repr(sbx) + repr(kv), "audit": cgw.audit_text(), "stderr": cgw.stderr()}.items():
        assert KV_SECRET not in text, (name, around(text, KV_SECRET))
        if name != "admission":
            assert phantom not in text, (name, around(text, phantom))
    assert not re.search(r"eyJ[\w-]{10,}\.eyJ", cgw.stderr()), "a JWT in the gateway log"


def test_local_backend_default_file_secret_and_jwks(cworld: World, tmp_path) -> None:
    """`egressgate run` without a broker section: the local backend (file secret 0600, local Ed25519 key
    created under var_dir/keys), so `make run` needs no Vault."""
    secret_file = tmp_path / "kv-secret"
    secret_file.write_text(KV_SECRET + "\n")
    os.chmod(secret_file, 0o600)
    gw = launch(cworld, tmp_path, None, broker={}, file_secret=str(secret_file))
    try:
        assert (gw.var / "keys" / "jwt-ed25519.pem").stat().st_mode & 0o077 == 0
        keys = httpx.get(f"http://{gw.admin}/.well-known/jwks.json", trust_env=False, timeout=5).json()["keys"]
        assert len(keys) == 1 and "d" not in keys[0]
        sbx = gw.admit("cred-kv")
        mark = cworld.hits.mark()
        with gw.client(sbx) as c:
            assert c.get(gw.url("api.test", "/echo")).status_code == 200
        assert last(gw, mark, "api.test")["auth"] == [f"Bearer {KV_SECRET}"]
    finally:
        stop_and_replay(gw)  # type: ignore[arg-type]


def test_local_backend_refuses_vault_capabilities_at_start(cworld: World, tmp_path) -> None:
    """A policy set whose capabilities the configured backend cannot serve is a load error (the gateway
    refuses to start), never a run of per-request credential_unavailable denies."""
    with pytest.raises(RuntimeError, match="needs broker backend 'vault'"):
        gw = launch(cworld, tmp_path, None, broker={})  # the policies use KV v2 sources
        stop_and_replay(gw)  # type: ignore[arg-type]  # only reached if it started (the test then fails)
