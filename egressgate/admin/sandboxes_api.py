"""`GET /v1/sandboxes` and `GET /v1/sandboxes/{id}`: what the registry knows about sandboxes.

The list reads the shared registry (every replica's admissions when the state is in Redis); the detail adds
the sandbox's usage and what is left of each budget of its policy - the same numbers `decide()` compares
(`outbound_bytes_max` against bytes out, a rule's `budget` against its usage, the DNS budget against the
query counters) - and its open connections. Connections are those of the gateway process that answered:
each process holds its own (with several workers or replicas, ask each, or read /metrics of each).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from egressgate.admin.errors import error_response, state_unavailable
from egressgate.gateway.shared.context import Runtime
from egressgate.policy.facts import SandboxState
from egressgate.state.base import SandboxRecord, StateUnavailable

BOOL = {"true": True, "false": False}


def summary(rt: Runtime, record: SandboxRecord) -> dict[str, Any]:
    return {"id": record.id, "policy": record.policy_name, "labels": dict(record.labels),
            "addresses": list(record.addresses), "admitted_at": float(record.admitted_at),
            "revoked": bool(record.revoked), "connections": len(rt.by_sandbox.get(record.id, ()))}


def _left(limit: int | None, used: int) -> dict[str, int] | None:
    return None if limit is None else {"limit": limit, "used": used, "left": max(0, limit - used)}


def budgets(policy: Any, state: SandboxState) -> dict[str, Any]:
    """What is left of every budget the policy sets (null: that budget is not set)."""
    dns = policy.model.network.dns.budget
    rules: dict[str, Any] = {}
    for rule in policy.rules:
        if rule.budget is None:
            continue
        usage = state.rule_usage.get(rule.id)
        rules[rule.id] = {"requests": _left(rule.budget.requests, usage.requests if usage else 0),
                          "bytes": _left(rule.budget.bytes, usage.bytes if usage else 0)}
    return {"outbound_bytes": _left(policy.outbound_bytes_max, state.bytes_out),
            "dns_queries": _left(dns.queries if dns else None, state.dns_queries),
            "dns_name_bytes": _left(dns.name_bytes if dns else None, state.dns_name_bytes),
            "rules": rules}


class SandboxesApi:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def list(self, request: web.Request) -> web.Response:
        """All sandboxes, optionally only those of `?policy=NAME` and/or `?revoked=true|false`."""
        unknown = set(request.query) - {"policy", "revoked"}
        if unknown:
            return error_response(400, "invalid_request", "query parameters: policy, revoked")
        revoked = request.query.get("revoked")
        if revoked is not None and revoked not in BOOL:
            return error_response(400, "invalid_request", "revoked: true or false")
        policy = request.query.get("policy")
        try:
            records = await self.rt.state.list_sandboxes()
        except StateUnavailable:
            return state_unavailable()
        out = [summary(self.rt, r) for r in sorted(records, key=lambda r: (r.admitted_at, r.id))
               if (policy is None or r.policy_name == policy) and (revoked is None or r.revoked is BOOL[revoked])]
        return web.json_response({"sandboxes": out})

    async def show(self, request: web.Request) -> web.Response:
        sandbox_id = request.match_info["sandbox_id"]
        try:
            record = await self.rt.state.get(sandbox_id)
            if record is None:
                return error_response(404, "unknown_sandbox", f"no sandbox {sandbox_id!r} was admitted")
            state = self.rt.ledger.spent_view(await self.rt.state.snapshot(sandbox_id))
        except StateUnavailable:
            return state_unavailable()
        except KeyError:  # admitted, then gone from the store between the two reads
            return error_response(404, "unknown_sandbox", f"no sandbox {sandbox_id!r} was admitted")
        policy = self.rt.policies.get(record.policy_name)
        body = summary(self.rt, record)
        body.update({
            # the policy the sandbox is decided by now (a reload may have changed it since admission);
            # null when the active set no longer has it (its requests are then denied policy_unavailable)
            "policy_hash": policy.hash if policy is not None else None,
            "usage": {"bytes_out": state.bytes_out, "bytes_in": state.bytes_in, "dns_queries": state.dns_queries,
                      "dns_name_bytes": state.dns_name_bytes, "hosts_contacted": len(state.seen_hosts),
                      "rules": {rule: {"requests": u.requests, "bytes": u.bytes}
                                for rule, u in sorted(state.rule_usage.items())}},
            "budgets": budgets(policy, state) if policy is not None else None,
        })
        return web.json_response(body)
