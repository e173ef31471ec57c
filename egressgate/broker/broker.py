"""The broker: turns (capability, sandbox, audience) into a short-lived credential, cheaply.

Minting costs a Vault round trip (milliseconds); a request path cannot pay that per request. So each
credential is cached per (capability, sandbox, audience) and reused until `reuse_fraction` (80 %) of its
lifetime is spent, leaving the upstream a comfortable validity margin; concurrent misses for one key
share a single in-flight mint (single-flight), so a burst of N requests makes one backend call. Failures
are not cached: the next request retries, and every failure surfaces as `CredentialUnavailable`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from egressgate.broker import jwt
from egressgate.broker.base import Backend
from egressgate.broker.config import (
    BrokerConfig,
    JwtCapability,
    StaticCapability,
    VaultOidcCapability,
    VaultSource,
)
from egressgate.broker.credential import Credential, CredentialUnavailable

log = logging.getLogger("egressgate.broker")

CacheKey = tuple[str, Any, str, str]


def _retrieve(task: asyncio.Task[Credential]) -> None:
    """Mark a failed mint's exception as seen even when every waiter has gone away."""
    if not task.cancelled():
        task.exception()


class Broker:
    def __init__(
        self,
        backend: Backend,
        *,
        issuer: str = "egressgate",
        reuse_fraction: float = 0.8,
        cache_max_entries: int = 10000,
    ) -> None:
        self.backend = backend
        self.issuer = issuer
        self.reuse_fraction = reuse_fraction
        self.cache_max_entries = cache_max_entries
        self._cache: OrderedDict[CacheKey, Credential] = OrderedDict()
        self._inflight: dict[CacheKey, asyncio.Task[Credential]] = {}
        self.hits = 0
        self.mints = 0

    @classmethod
    def from_config(cls, config: BrokerConfig) -> Broker:
        backend: Backend
        if config.backend == "vault":
            from egressgate.broker.vault import VaultBackend

            backend = VaultBackend(config)
        else:
            from egressgate.broker.local import LocalBackend

            backend = LocalBackend(config.local_key_dir)
        return cls(
            backend,
            issuer=config.issuer,
            reuse_fraction=config.reuse_fraction,
            cache_max_entries=config.cache_max_entries,
        )

    async def start(self) -> None:
        await self.backend.start()

    async def aclose(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        await self.backend.aclose()
        self._cache.clear()

    def check(self, name: str, capability: Any) -> str | None:
        """A load-time problem with `capability` under this backend (None when it can work)."""
        if self.backend.name == "local":
            if isinstance(capability, VaultOidcCapability):
                return f"capability {name!r}: vault_oidc needs broker backend 'vault'"
            if isinstance(capability, StaticCapability) and isinstance(capability.source, VaultSource):
                return f"capability {name!r}: a vault source needs broker backend 'vault'"
        return None

    async def issue(
        self,
        name: str,
        capability: StaticCapability | JwtCapability | VaultOidcCapability,
        sandbox_id: str,
        audience: str,
        now: float,
        *,
        max_ttl_seconds: int = 300,
    ) -> Credential:
        """The credential for `capability` (policy name `name`) as `sandbox_id` talking to `audience`.

        `audience` is the canonical destination host; a jwt capability with a configured audience uses
        that instead. `now` is wall-clock seconds (the caller's clock: tests and replays pass their own).
        """
        if max_ttl_seconds <= 0:
            raise ValueError("max_ttl_seconds must be positive")
        key: CacheKey = (name, capability, sandbox_id, audience)
        cached = self._cache.get(key)
        if cached is not None and cached.reusable(now, self.reuse_fraction):
            self.hits += 1
            self._cache.move_to_end(key)
            return cached
        task = self._inflight.get(key)
        if task is None:
            # The mint runs as its own task: a waiter that is cancelled (client went away) neither
            # cancels the shared mint nor loses the result for the others; it is cached either way.
            task = asyncio.create_task(
                self._mint_and_store(key, name, capability, sandbox_id, audience, now, max_ttl_seconds)
            )
            task.add_done_callback(_retrieve)
            self._inflight[key] = task
        else:
            self.hits += 1
        return await asyncio.shield(task)

    async def _mint_and_store(
        self,
        key: CacheKey,
        name: str,
        capability: StaticCapability | JwtCapability | VaultOidcCapability,
        sandbox_id: str,
        audience: str,
        now: float,
        max_ttl_seconds: int,
    ) -> Credential:
        try:
            credential = await self._mint(name, capability, sandbox_id, audience, now, max_ttl_seconds)
        except CredentialUnavailable:
            raise
        except Exception as exc:  # anything unexpected still fails closed, with one error type
            raise CredentialUnavailable(f"capability {name!r}: {type(exc).__name__}") from exc
        else:
            self._store(key, credential, now)
            return credential
        finally:
            self._inflight.pop(key, None)

    def _store(self, key: CacheKey, credential: Credential, now: float) -> None:
        self._cache[key] = credential
        self._cache.move_to_end(key)
        if len(self._cache) > self.cache_max_entries:
            for k in [k for k, c in self._cache.items() if c.expires_at <= now]:
                del self._cache[k]
            while len(self._cache) > self.cache_max_entries:
                self._cache.popitem(last=False)

    async def _mint(
        self,
        name: str,
        capability: StaticCapability | JwtCapability | VaultOidcCapability,
        sandbox_id: str,
        audience: str,
        now: float,
        max_ttl: int,
    ) -> Credential:
        self.mints += 1
        if isinstance(capability, StaticCapability):
            value, key_id = await self.backend.fetch_static(capability)
            ttl = capability.ttl_seconds
            return Credential(name, value, key_id, now, now + ttl)
        if isinstance(capability, JwtCapability):
            ttl = min(capability.ttl_seconds, max_ttl)
            aud = capability.audience or audience
            kid = await self.backend.signing_kid()
            claims = jwt.claims(self.issuer, sandbox_id, aud, now, ttl)
            signing_input = jwt.signing_input(kid, claims)
            signature = await self.backend.sign(kid, signing_input)
            token = jwt.assemble(signing_input, signature)
            return Credential(name, token, kid, float(claims["iat"]), float(claims["exp"]))
        if isinstance(capability, VaultOidcCapability):
            token = await self.backend.oidc_token(capability.role)
            try:
                header, payload = jwt.unverified_parts(token)
                iat, exp = float(payload["iat"]), float(payload["exp"])
            except (ValueError, KeyError, TypeError):
                raise CredentialUnavailable(f"capability {name!r}: oidc token without iat/exp") from None
            # The role's TTL is Vault's setting; a token that outlives the policy's ceiling is refused
            # (fail closed) rather than silently handed out.
            if exp - iat > max_ttl:
                raise CredentialUnavailable(
                    f"capability {name!r}: oidc role {capability.role!r} ttl {int(exp - iat)}s exceeds "
                    f"max_ttl_seconds {max_ttl}"
                )
            if exp <= now:
                raise CredentialUnavailable(f"capability {name!r}: oidc token already expired")
            return Credential(name, token, str(header.get("kid", "oidc")), now, exp)
        raise CredentialUnavailable(f"capability {name!r}: unsupported type")

    def forget(self, sandbox_id: str) -> int:
        """Drop a sandbox's cached credentials (call on revocation); returns how many were dropped."""
        keys = [k for k in self._cache if k[2] == sandbox_id]
        for k in keys:
            del self._cache[k]
        return len(keys)

    async def jwks(self) -> dict[str, list[dict[str, str]]]:
        """The JWKS document for /.well-known/jwks.json (public keys of the JWT signer)."""
        return {"keys": await self.backend.public_jwks()}
