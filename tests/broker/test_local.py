"""The embedded local backend: owner-only secret files, a 0600 signing key, verifiable JWTs."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from egressgate.broker.broker import Broker
from egressgate.broker.config import BrokerConfig, Capability
from egressgate.broker.credential import CredentialUnavailable
from egressgate.broker.local import KEY_FILE
from tests.support import jwtcheck

CAP = TypeAdapter(Capability)
SECRET = "sk-file-0123456789abcdef"


def file_cap(path: Path):
    return CAP.validate_python({"type": "static", "source": {"file": str(path)}})


@pytest.fixture
async def local(tmp_path: Path):
    b = Broker.from_config(BrokerConfig(local_key_dir=str(tmp_path / "keys")))
    await b.start()
    yield b
    await b.aclose()


def secret_file(tmp_path: Path, mode: int, content: str = SECRET + "\n") -> Path:
    p = tmp_path / f"secret-{mode:o}"
    p.write_text(content)
    os.chmod(p, mode)
    return p


async def test_private_file_is_read(local: Broker, tmp_path: Path) -> None:
    cred = await local.issue("openai", file_cap(secret_file(tmp_path, 0o600)), "s", "h", time.time())
    assert cred.value == SECRET  # trailing newline dropped
    assert cred.key_id.startswith("file:") and SECRET not in cred.key_id
    ro = await local.issue("ro", file_cap(secret_file(tmp_path, 0o400)), "s", "h", time.time())
    assert ro.value == SECRET


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o610, 0o601, 0o660, 0o666])
async def test_exposed_file_is_refused(local: Broker, tmp_path: Path, mode: int) -> None:
    with pytest.raises(CredentialUnavailable, match="group/other"):
        await local.issue("openai", file_cap(secret_file(tmp_path, mode)), "s", "h", time.time())


async def test_symlink_is_judged_by_its_target(local: Broker, tmp_path: Path) -> None:
    exposed = secret_file(tmp_path, 0o644)
    link = tmp_path / "link"
    link.symlink_to(exposed)
    with pytest.raises(CredentialUnavailable, match="group/other"):
        await local.issue("openai", file_cap(link), "s", "h", time.time())


async def test_not_a_regular_file_or_missing(local: Broker, tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(CredentialUnavailable, match="not a regular file"):
        await local.issue("x", file_cap(d), "s", "h", time.time())
    with pytest.raises(CredentialUnavailable, match="cannot open"):
        await local.issue("x", file_cap(tmp_path / "missing"), "s", "h", time.time())


async def test_foreign_owner_is_refused(local: Broker, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    p = secret_file(tmp_path, 0o600)
    os.chown(p, 65534, -1)
    with pytest.raises(CredentialUnavailable, match="not the gateway user"):
        await local.issue("x", file_cap(p), "s", "h", time.time())


@pytest.mark.parametrize("content", ["", "\n", "two\nlines\n", "nul\x00byte"])
async def test_malformed_secret_is_refused(local: Broker, tmp_path: Path, content: str) -> None:
    with pytest.raises(CredentialUnavailable, match="empty or contains"):
        await local.issue("x", file_cap(secret_file(tmp_path, 0o600, content)), "s", "h", time.time())


async def test_signing_key_created_private_and_reused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    a = Broker.from_config(BrokerConfig(local_key_dir=str(keys)))
    await a.start()
    assert stat.S_IMODE((keys / KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    b = Broker.from_config(BrokerConfig(local_key_dir=str(keys)))
    await b.start()
    assert await a.jwks() == await b.jwks()  # same key after a restart
    os.chmod(keys / KEY_FILE, 0o644)
    with pytest.raises(CredentialUnavailable, match="group/other"):
        await Broker.from_config(BrokerConfig(local_key_dir=str(keys))).start()


async def test_local_jwt_verifies_with_jwks(local: Broker) -> None:
    cap = CAP.validate_python({"type": "jwt"})
    now = time.time()
    cred = await local.issue("svc", cap, "sbx-7", "api.example.test", now, max_ttl_seconds=60)
    claims = jwtcheck.verify(cred.value, await local.jwks(), audience="api.example.test", now=now)
    assert claims["sub"] == "sbx-7" and claims["exp"] - claims["iat"] == 60
    assert (await local.jwks())["keys"][0]["kid"] == cred.key_id


async def test_local_refuses_vault_only_capabilities(local: Broker) -> None:
    oidc = CAP.validate_python({"type": "vault_oidc", "role": "r"})
    kv = CAP.validate_python({"type": "static", "source": {"vault": {"path": "a/b", "field": "f"}}})
    assert "vault_oidc needs" in (local.check("o", oidc) or "")
    assert "vault source needs" in (local.check("k", kv) or "")
    for cap in (oidc, kv):
        with pytest.raises(CredentialUnavailable, match="backend 'vault'"):
            await local.issue("x", cap, "s", "h", time.time())


async def test_failures_are_not_cached_and_burst_shares_failure(local: Broker, tmp_path: Path) -> None:
    p = secret_file(tmp_path, 0o644)
    cap = file_cap(p)
    results = await asyncio.gather(*(local.issue("x", cap, "s", "h", 1000.0) for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, CredentialUnavailable) for r in results)
    assert local.backend.calls == 1  # one attempt for the whole burst
    os.chmod(p, 0o600)  # fixed: the next request succeeds (the failure was not cached)
    assert (await local.issue("x", cap, "s", "h", 1000.0)).value == SECRET


async def test_cancelled_waiter_does_not_cancel_the_shared_mint(local: Broker, tmp_path: Path) -> None:
    cap = file_cap(secret_file(tmp_path, 0o600))
    first = asyncio.create_task(local.issue("x", cap, "s", "h", 1000.0))
    await asyncio.sleep(0)  # the mint is now in flight (reading the file in a worker thread)
    first.cancel()
    cred = await local.issue("x", cap, "s", "h", 1000.0)
    assert cred.value == SECRET and local.backend.calls == 1
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_forget_drops_a_revoked_sandboxs_credentials(local: Broker) -> None:
    cap = CAP.validate_python({"type": "jwt"})
    a = await local.issue("j", cap, "revoked", "h", 1000.0)
    b = await local.issue("j", cap, "other", "h", 1000.0)
    assert local.forget("revoked") == 1
    assert await local.issue("j", cap, "revoked", "h", 1000.0) is not a  # minted again
    assert await local.issue("j", cap, "other", "h", 1000.0) is b


async def test_cache_is_bounded(tmp_path: Path) -> None:
    from egressgate.broker.local import LocalBackend

    b = Broker(LocalBackend(str(tmp_path / "k")), cache_max_entries=3)
    await b.start()
    cap = CAP.validate_python({"type": "jwt"})
    for i in range(5):
        await b.issue("j", cap, f"s{i}", "h", 1000.0)
    assert len(b._cache) == 3 and {k[2] for k in b._cache} == {"s2", "s3", "s4"}
