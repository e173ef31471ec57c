"""`GET /v1/policies` and `POST /v1/policies/reload`.

The active policy set is identified by one version hash (admin/metrics.py `policy_set_version`: over every
policy's name and content hash), so an operator or a deploy script can tell which set a replica runs and
whether two replicas agree. A reload through the API is the same reload as SIGHUP and the file watch
(gateway/service/app.py `Gateway.reload`): all files valid or nothing changes, and it is audited either way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from egressgate.admin.errors import error_response
from egressgate.admin.metrics import policy_set_version
from egressgate.gateway.shared.context import Runtime

Reload = Callable[[str], Awaitable[bool]]


def describe(policies: dict[str, Any]) -> dict[str, Any]:
    return {"version": policy_set_version(policies),
            "policies": [{"name": name, "hash": policies[name].hash, "source": str(policies[name].source)}
                         for name in sorted(policies)]}


class PoliciesApi:
    def __init__(self, rt: Runtime, reload: Reload | None) -> None:
        self.rt = rt
        self._reload = reload

    async def list(self, _request: web.Request) -> web.Response:
        return web.json_response(describe(self.rt.policies.policies))

    async def reload(self, _request: web.Request) -> web.Response:
        if self._reload is None:
            return error_response(503, "reload_unavailable", "this admin server cannot reload policies")
        if not await self._reload("admin API"):
            return error_response(
                422, "policy_invalid", "the policy files were rejected and the previous set stays active; "
                "the gateway log and the policy_reload audit record name every problem",
                **describe(self.rt.policies.policies))
        return web.json_response({"reloaded": True, **describe(self.rt.policies.policies)})
