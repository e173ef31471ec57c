"""Vault/OpenBao backend (hvac): KV v2 statics, transit-signed JWTs, identity OIDC tokens.

hvac is synchronous (requests), so every call runs in a worker thread. The gateway authenticates as
itself (AppRole or a token file; credentials from the gateway's config or its own environment, never the
sandbox's), renews its token in the background, and on a 403 logs in again once before giving up. Every
failure becomes `CredentialUnavailable`: the caller denies, nothing is sent without its credential.
The transit private key never leaves Vault; we only ever see signatures and public keys.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import hvac
import hvac.exceptions
import requests

from egressgate.broker.config import BrokerConfig, FileSource, StaticCapability, VaultSource
from egressgate.broker.credential import CredentialUnavailable
from egressgate.broker.jwt import okp_jwk
from egressgate.broker.local import read_private_file, read_secret_file

log = logging.getLogger("egressgate.broker.vault")
T = TypeVar("T")
KEY_INFO_TTL = 60.0  # seconds a transit key's version list is trusted before re-reading
ENV_ROLE_ID = "EGRESSGATE_VAULT_ROLE_ID"
ENV_SECRET_ID = "EGRESSGATE_VAULT_SECRET_ID"  # noqa: S105 (a variable name)
ENV_TOKEN = "EGRESSGATE_VAULT_TOKEN"  # noqa: S105 (a variable name)


def _vault_message(exc: hvac.exceptions.VaultError) -> str:
    errors = getattr(exc, "errors", None) or []
    detail = " ".join("; ".join(str(e) for e in errors).split())[:200] if errors else ""
    return f"{type(exc).__name__}{': ' + detail if detail else ''}"


class VaultBackend:
    name = "vault"

    def __init__(self, config: BrokerConfig, env: dict[str, str] | None = None) -> None:
        if not config.vault_addr:
            raise ValueError("vault backend needs vault_addr")
        self.config = config
        self._env = dict(os.environ if env is None else env)
        session = requests.Session()
        session.trust_env = False  # the gateway's proxy env must never reroute (or see) Vault traffic
        self.client = hvac.Client(
            url=config.vault_addr,
            token="",
            verify=config.ca_bundle or True,
            timeout=config.timeout_seconds,
            allow_redirects=False,
            session=session,
        )
        self.calls = 0  # round trips for credentials (KV, sign, read key, OIDC)
        self.logins = 0
        self.renewals = 0
        self._generation = 0
        self._login_lock = asyncio.Lock()
        self._token_ttl = 0
        self._token_renewable = False
        self._renew_task: asyncio.Task[None] | None = None
        self._key_versions: dict[str, int] = {}  # kid -> transit key version
        self._jwks: list[dict[str, str]] = []
        self._latest_kid: str | None = None
        self._key_read_at = -KEY_INFO_TTL
        self.key_info_ttl = KEY_INFO_TTL

    # --- authentication ---------------------------------------------------------------------

    def _approle_creds(self) -> tuple[str, str]:
        cfg = self.config
        role_id = cfg.role_id.get_secret_value() if cfg.role_id else self._env.get(ENV_ROLE_ID)
        if cfg.secret_id:
            secret_id = cfg.secret_id.get_secret_value()
        elif cfg.secret_id_file:
            secret_id = read_private_file(cfg.secret_id_file)[0].decode().strip()
        else:
            secret_id = self._env.get(ENV_SECRET_ID)
        if not role_id or not secret_id:
            raise CredentialUnavailable(
                f"approle auth needs role_id and secret_id (config or {ENV_ROLE_ID}/{ENV_SECRET_ID})"
            )
        return role_id, secret_id

    def _token(self) -> str:
        if self.config.token_file:
            return read_private_file(self.config.token_file)[0].decode().strip()
        token = self._env.get(ENV_TOKEN)
        if not token:
            raise CredentialUnavailable(f"token auth needs token_file or {ENV_TOKEN}")
        return token

    def _login_sync(self) -> tuple[int, bool]:
        if self.config.auth == "approle":
            role_id, secret_id = self._approle_creds()
            resp = self.client.auth.approle.login(
                role_id=role_id, secret_id=secret_id, mount_point=self.config.approle_mount
            )
            auth = resp["auth"]
            return int(auth["lease_duration"]), bool(auth["renewable"])
        self.client.token = self._token()
        data = self.client.auth.token.lookup_self()["data"]
        return int(data.get("ttl") or 0), bool(data.get("renewable"))

    async def _login(self) -> None:
        try:
            ttl, renewable = await asyncio.to_thread(self._login_sync)
        except hvac.exceptions.VaultError as exc:
            raise CredentialUnavailable(f"vault login failed: {_vault_message(exc)}") from None
        except requests.RequestException as exc:
            raise CredentialUnavailable(f"vault unreachable at login: {type(exc).__name__}") from None
        self._token_ttl, self._token_renewable = ttl, renewable
        self._generation += 1
        self.logins += 1
        log.info("vault login ok (auth=%s ttl=%ss renewable=%s)", self.config.auth, ttl, renewable)

    async def _relogin(self, seen_generation: int) -> None:
        async with self._login_lock:
            if self._generation == seen_generation:  # nobody else re-logged in meanwhile
                await self._login()

    async def start(self) -> None:
        async with self._login_lock:
            await self._login()
        self._renew_task = asyncio.create_task(self._renew_loop(), name="vault-token-renew")

    async def aclose(self) -> None:
        if self._renew_task is not None:
            self._renew_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renew_task
            self._renew_task = None
        self.client.adapter.close()

    async def _renew_loop(self) -> None:
        """Keep the gateway's own token alive: renew renewable tokens; log in again (AppRole) when the
        token hits its max TTL; when renewal fails, log in again / re-read the token file."""
        while True:
            ttl = self._token_ttl
            if ttl <= 0:
                return  # non-expiring token (e.g. root in dev)
            if not self._token_renewable and self.config.auth != "approle":
                return
            await asyncio.sleep(max(0.2, ttl * self.config.renew_fraction))
            try:
                if self._token_renewable:
                    resp = await asyncio.to_thread(self.client.auth.token.renew_self)
                    new_ttl = int(resp["auth"]["lease_duration"])
                    self.renewals += 1
                    if new_ttl < ttl * (1 - self.config.renew_fraction) and self.config.auth == "approle":
                        await self._relogin(self._generation)  # near max TTL: renewal no longer helps
                    else:
                        self._token_ttl = new_ttl
                else:
                    await self._relogin(self._generation)
            except Exception as exc:  # the loop must survive anything, or the token silently expires
                log.warning("vault token renewal failed: %s", type(exc).__name__)
                # AppRole logs in afresh; token auth re-reads its file (an agent may have rotated it)
                with contextlib.suppress(CredentialUnavailable):
                    await self._relogin(self._generation)
                await asyncio.sleep(1.0)

    async def _call(self, op: Callable[[hvac.Client], T]) -> T:
        """Run one hvac call off the loop; on 403 re-login once and retry; map every failure."""
        for attempt in (1, 2):
            generation = self._generation
            self.calls += 1
            try:
                return await asyncio.to_thread(op, self.client)
            except hvac.exceptions.Forbidden as exc:
                if attempt == 2:
                    raise CredentialUnavailable(f"vault denied: {_vault_message(exc)}") from None
                log.info("vault answered 403; logging in again")
                await self._relogin(generation)
            except hvac.exceptions.VaultError as exc:
                raise CredentialUnavailable(f"vault error: {_vault_message(exc)}") from None
            except requests.RequestException as exc:
                raise CredentialUnavailable(f"vault unreachable: {type(exc).__name__}") from None
        raise AssertionError("unreachable")

    # --- static secrets ---------------------------------------------------------------------

    async def fetch_static(self, capability: StaticCapability) -> tuple[str, str]:
        source = capability.source
        if isinstance(source, FileSource):
            return await asyncio.to_thread(read_secret_file, source)
        assert isinstance(source, VaultSource)
        ref = source.vault
        mount = ref.mount or self.config.kv_mount
        resp: dict[str, Any] = await self._call(
            lambda c: c.secrets.kv.v2.read_secret_version(
                path=ref.path, mount_point=mount, raise_on_deleted_version=True
            )
        )
        try:
            data, meta = resp["data"]["data"], resp["data"]["metadata"]
        except (KeyError, TypeError):
            raise CredentialUnavailable(f"kv {mount}/{ref.path}: malformed response") from None
        value = data.get(ref.field) if isinstance(data, dict) else None
        if not isinstance(value, str) or not value or any(ch in value for ch in "\r\n\x00"):
            raise CredentialUnavailable(f"kv {mount}/{ref.path}: field {ref.field!r} missing or not a string")
        return value, f"kv:{mount}/{ref.path}#{ref.field}@v{meta.get('version')}"

    # --- transit JWT signing ----------------------------------------------------------------

    async def transit_key_info(self, key_name: str) -> tuple[int, dict[int, bytes]]:
        """(latest version, {version: raw Ed25519 public key}) of a transit key; refuses other types."""
        cfg = self.config
        resp = await self._call(lambda c: c.secrets.transit.read_key(key_name, mount_point=cfg.transit_mount))
        data = resp["data"]
        if data.get("type") != "ed25519":
            raise CredentialUnavailable(f"transit key {key_name!r} is {data.get('type')!r}, need ed25519")
        try:
            keys = {int(v): base64.b64decode(info["public_key"]) for v, info in data["keys"].items()}
            latest = int(data["latest_version"])
        except (KeyError, TypeError, ValueError):
            raise CredentialUnavailable(f"transit key {key_name!r}: malformed key listing") from None
        if latest not in keys:
            raise CredentialUnavailable(f"transit key {key_name!r}: latest version has no public key")
        return latest, keys

    async def transit_sign(self, key_name: str, version: int, data: bytes) -> bytes:
        """Raw Ed25519 signature by version `version` of transit key `key_name` (the key stays in Vault)."""
        cfg = self.config
        resp = await self._call(
            lambda c: c.secrets.transit.sign_data(
                key_name,
                hash_input=base64.b64encode(data).decode(),
                key_version=version,
                mount_point=cfg.transit_mount,
            )
        )
        signature = resp["data"]["signature"]  # "vault:v<N>:<base64 std>"
        prefix, _, b64 = signature.rpartition(":")
        if prefix != f"vault:v{version}":
            raise CredentialUnavailable("transit signed with an unexpected key version")
        return base64.b64decode(b64)

    async def _refresh_key(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._key_read_at < self.key_info_ttl and self._latest_kid:
            return
        latest, keys = await self.transit_key_info(self.config.transit_key)
        versions: dict[str, int] = {}
        jwks: list[dict[str, str]] = []
        for ver in sorted(keys):
            jwk = okp_jwk(keys[ver])
            versions[jwk["kid"]] = ver
            jwks.append(jwk)
        self._key_versions, self._jwks = versions, jwks
        self._latest_kid = okp_jwk(keys[latest])["kid"]
        self._key_read_at = time.monotonic()

    async def signing_kid(self) -> str:
        await self._refresh_key()
        assert self._latest_kid is not None
        return self._latest_kid

    async def sign(self, kid: str, data: bytes) -> bytes:
        version = self._key_versions.get(kid)
        if version is None:
            raise CredentialUnavailable(f"unknown transit key id {kid!r}")
        return await self.transit_sign(self.config.transit_key, version, data)

    async def public_jwks(self) -> list[dict[str, str]]:
        await self._refresh_key()
        return [dict(j) for j in self._jwks]

    # --- identity OIDC ----------------------------------------------------------------------

    async def oidc_token(self, role: str) -> str:
        resp = await self._call(lambda c: c.secrets.identity.generate_signed_id_token(name=role))
        token = (resp.get("data") or {}).get("token")
        if not isinstance(token, str) or token.count(".") != 2:
            raise CredentialUnavailable(f"oidc role {role!r}: no token in response")
        return token
