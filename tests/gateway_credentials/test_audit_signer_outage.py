"""A Vault/OpenBao outage must not stop traffic that does not need Vault. The audit checkpoints are signed
by the Vault transit key; with the real OpenBao process stopped, checkpoints are deferred, plain routes
keep working past several checkpoints and only credentialed routes are denied (`credential_unavailable`).
When the same OpenBao comes back the deferred range is signed and `audit verify` passes, listing it."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from egressgate.audit.signer import public_pem
from tests.support import cli
from tests.support.bao_persistent import PersistentBao
from tests.support.credworld import World, launch
from tests.support.launcher import EGRESSGATE
from tests.support.replay_check import stop_and_replay


def transit_pub(bao: PersistentBao, path: Path) -> Path:
    keys = bao.root().secrets.transit.read_key("egressgate-audit")["data"]["keys"]
    raw = base64.b64decode(keys[max(keys, key=int)]["public_key"])
    path.write_bytes(public_pem(Ed25519PublicKey.from_public_bytes(raw)))
    return path


def signer_status(gw) -> dict:
    return httpx.get(f"http://{gw.admin}/healthz", trust_env=False, timeout=5).json()["audit_status"]["signer"]


def test_vault_outage_defers_audit_signatures_and_only_credentialed_routes_fail(cworld: World, tmp_path) -> None:
    bao = PersistentBao(home=tmp_path / "bao").start()
    (tmp_path / "gw").mkdir()
    try:
        pub = transit_pub(bao.configure(), tmp_path / "transit.pub")
        gw = launch(cworld, tmp_path / "gw", bao, kv_ttl=1, audit={"checkpoint_every": 3})
    except BaseException:
        bao.stop()
        raise
    try:
        sbx = gw.admit("cred-kv")
        with gw.client(sbx) as c:
            assert c.get(gw.url("api.test", "/echo")).status_code == 200  # credentialed, Vault up
            bao.stop()  # the real OpenBao process stops
            time.sleep(1.1)  # the cached secret expires
            for i in range(12):  # four checkpoints fall due while the signer is down
                r = c.get(gw.url("api.test", f"/open/{i}"))
                assert r.status_code == 200, (i, r.text)
            r = c.get(gw.url("api.test", "/echo"))
            assert r.status_code == 403 and r.json()["reason"] == "credential_unavailable", r.text
            down = signer_status(gw)
            assert not down["available"] and down["deferred_checkpoints"] >= 3, down
            bao.start()  # the same OpenBao comes back (same storage, same keys)
            deadline = time.monotonic() + 30
            while not signer_status(gw)["available"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert signer_status(gw)["available"]
            assert c.get(gw.url("api.test", "/echo")).status_code == 200  # credentialed works again
    finally:
        assert stop_and_replay(gw) == 0  # type: ignore[arg-type]
        bao.stop()
    res = cli.run([EGRESSGATE, "audit", "verify", "--public-key", str(pub), str(gw.var / "audit.jsonl")],
                  timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "deferred (signer unavailable)" in res.stderr and "signed late" in res.stderr, res.stderr
