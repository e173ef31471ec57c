"""`/readyz`: may this gateway process take traffic? One status per component it cannot work without.

- `state`: the state store answers a ping (Redis: a round trip) - without it every request is denied
  `state_unavailable`.
- `audit`: the audit sink accepts records - without it new requests are denied `audit_unavailable`.
- `broker`: the credential backend answers (local keys loaded; Vault: the gateway's token is accepted,
  a `token/lookup-self` round trip). It only makes the gateway unready when some loaded policy has a
  capability (`required`): a gateway without credentialed routes serves everything without it.

200 `ready` when every required component is `ok`, else 503 `not_ready`. Like /healthz it needs no token
(probes rarely carry one) and says nothing secret: statuses and the kind of each failure (the exception's
text, which may hold a URL with a password, goes to the log only). Probing is bounded: a
result is reused for `ttl` seconds and concurrent probes share one check, so hammering /readyz cannot
hammer Redis or Vault.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from egressgate.gateway.shared.context import Runtime

logger = logging.getLogger(__name__)


def _failed(exc: BaseException) -> str:
    """The kind of failure only: /readyz is public, and an exception's text may carry a backend URL with
    its password or a token; the detail goes to the log."""
    if isinstance(exc, TimeoutError):
        return "did not answer in time"
    return type(exc).__name__


class Readiness:
    def __init__(self, rt: Runtime, *, timeout: float = 2.0, ttl: float = 1.0) -> None:
        self.rt = rt
        self.timeout = timeout
        self.ttl = ttl
        self._result: tuple[float, bool, dict[str, Any]] | None = None
        self._running: asyncio.Task | None = None

    async def handle(self, _request: web.Request) -> web.Response:
        ready, components = await self.check()
        return web.json_response({"status": "ready" if ready else "not_ready", "components": components},
                                 status=200 if ready else 503, headers={"Cache-Control": "no-store"})

    async def check(self) -> tuple[bool, dict[str, Any]]:
        now = time.monotonic()
        if self._result is not None and now - self._result[0] < self.ttl:
            return self._result[1], self._result[2]
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._check(), name="readyz")
        # shield: a probe that gives up does not cancel the check the others wait for
        ready, components = await asyncio.shield(self._running)
        self._result = (time.monotonic(), ready, components)
        return ready, components

    async def _check(self) -> tuple[bool, dict[str, Any]]:
        state, broker = await asyncio.gather(self._state(), self._broker())
        audit = self._audit()
        components = {"state": state, "audit": audit, "broker": broker}
        ready = all(c["status"] == "ok" or not c.get("required", True) for c in components.values())
        return ready, components

    async def _state(self) -> dict[str, Any]:
        try:
            await asyncio.wait_for(self.rt.state.ping(), self.timeout)
        except Exception as exc:  # StateUnavailable, a timeout, anything: not ready, with why
            logger.warning("readyz: state store not ready: %s", exc)
            return {"status": "unavailable", "message": f"state store: {_failed(exc)}"}
        return {"status": "ok"}

    def _audit(self) -> dict[str, Any]:
        if self.rt.audit.healthy():
            return {"status": "ok"}
        return {"status": "unavailable",
                "message": "the audit sink cannot make records durable; new requests are denied (see /healthz)"}

    async def _broker(self) -> dict[str, Any]:
        broker = self.rt.broker
        required = any(p.capabilities for p in self.rt.policies.policies.values())
        if broker is None:
            return {"status": "unavailable", "required": required, "message": "no credential broker"}
        backend = broker.backend
        try:
            if backend.name == "vault":
                await asyncio.wait_for(asyncio.to_thread(backend.client.auth.token.lookup_self), self.timeout)
            else:  # local keys: in memory once loaded
                await asyncio.wait_for(backend.public_jwks(), self.timeout)
        except Exception as exc:
            logger.warning("readyz: credential broker (%s) not ready: %s", backend.name, type(exc).__name__)
            return {"status": "unavailable", "required": required, "backend": backend.name,
                    "message": f"credential broker: {_failed(exc)}"}
        return {"status": "ok", "required": required, "backend": backend.name}
