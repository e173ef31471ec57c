"""The persistent-workspace part of the control API (issue 22; docs/openapi.yaml, docs/runtimes.md).

  POST /v1/workspaces/records  {"action", "workspace", "sandbox_id"?, "policy"?, "policy_hash"?, "decision",
                                "reason"?, "attributes": {...}}   -> one audit record, operation `workspace`
  POST /v1/workspaces/writes   {"sandbox_id", "workspace", "changes": [...], "manifest_hash",
                                "base_manifest_hash", "pending_ttl_seconds"?} -> a pending `persistent_write`

`sandbox run` (runtimes/persist.py) is the caller: the gateway owns the audit chain, so what the runtime did
to a workspace (saved with its manifest hash, restored and what was checked, refused as changed outside a
run) is recorded here. Attributes are strictly typed and bounded (namespaced `egressgate.workspace.*`,
scalars or short lists of strings): the runtime's report goes into the trail, never arbitrary JSON.

A persistent write becomes one approval listing every changed path (kind `persistent_write`); when it is
approved, denied or expires the gateway settles it (runtimes/workspaces.settle: the staged copy swapped in
atomically, or removed) and records `write_applied` / `write_discarded`. A gateway without permission on the
var dir (or another replica's) leaves that to the next `sandbox run` / `egressgate workspaces` on the host.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from egressgate.admin.errors import error_response
from egressgate.admin.jsonbody import BodyError, read_object
from egressgate.approvals.audit import approval_event
from egressgate.approvals.model import (
    KIND_PERSISTENT_WRITE,
    MAX_FOR_SECONDS,
    PENDING_TTL_SECONDS,
    Approval,
    ApprovalState,
    new_approval_id,
)
from egressgate.audit.build import build
from egressgate.audit.event import AuditUnavailable, EventKind
from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.admin.server import AdminServer
    from egressgate.gateway.shared.context import Runtime

logger = logging.getLogger(__name__)

ACTIONS = (
    "saved",
    "restored",
    "restore_refused",
    "changes_accepted",
    "removed",
    "write_staged",
    "write_applied",
    "write_discarded",
)
KEY = re.compile(r"^[a-z][a-z0-9_.]{0,63}$")
MAX_STR = 4096
MAX_LIST = 100
MAX_CHANGES = 100_000
PREFIX = "egressgate.workspace."


def register_workspaces(server: AdminServer) -> None:
    api = WorkspacesApi(server.rt)
    server.app.router.add_post("/v1/workspaces/records", api.record)
    server.app.router.add_post("/v1/workspaces/writes", api.write)


def _text(value: object, what: str, limit: int = MAX_STR) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limit or "\0" in value:
        raise BodyError(400, "invalid_request", f"{what}: a string of 1..{limit} characters")
    return value


def attributes(raw: object) -> dict[str, object]:
    if not isinstance(raw, dict) or len(raw) > 64:
        raise BodyError(400, "invalid_request", "attributes: an object of at most 64 keys")
    out: dict[str, object] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise BodyError(400, "invalid_request", f"attributes: key {key!r} is not [a-z][a-z0-9_.]*")
        if isinstance(value, bool) or (type(value) is int and 0 <= value < 2**53):
            out[PREFIX + key] = value
        elif isinstance(value, str):
            out[PREFIX + key] = _text(value, f"attributes.{key}")
        elif isinstance(value, list) and len(value) <= MAX_LIST:
            out[PREFIX + key] = [_text(v, f"attributes.{key}[]") for v in value]
        else:
            raise BodyError(
                400,
                "invalid_request",
                f"attributes.{key}: a boolean, a non-negative integer, a "
                f"string or a list of at most {MAX_LIST} strings",
            )
    return out


def changes(raw: object) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_CHANGES:
        raise BodyError(400, "invalid_request", f"changes: a list of 1..{MAX_CHANGES} changes")
    out = []
    for item in raw:
        if not isinstance(item, dict) or set(item) - {"path", "action", "type", "size", "sha256"}:
            raise BodyError(400, "invalid_request", "changes[]: {path, action, type, size, sha256}")
        if item.get("action") not in ("added", "changed", "removed"):
            raise BodyError(400, "invalid_request", "changes[].action: added, changed or removed")
        size = item.get("size")
        if size is not None and (type(size) is not int or size < 0):
            raise BodyError(400, "invalid_request", "changes[].size: null or a non-negative integer")
        out.append(
            {
                "path": _text(item.get("path"), "changes[].path"),
                "action": item["action"],
                "type": item.get("type") if item.get("type") in ("f", "d", "l", "o") else None,
                "size": size,
                "sha256": item.get("sha256") if isinstance(item.get("sha256"), str) else None,
            }
        )
    return out


class WorkspacesApi:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def record(self, request: web.Request) -> web.Response:
        try:
            body = await read_object(request)
            if set(body) - {
                "action",
                "workspace",
                "sandbox_id",
                "policy",
                "policy_hash",
                "decision",
                "reason",
                "message",
                "attributes",
            }:
                raise BodyError(
                    400,
                    "invalid_request",
                    "keys: action, workspace, sandbox_id, policy, policy_hash, decision, reason, message, attributes",
                )
            action = body.get("action")
            if action not in ACTIONS:
                raise BodyError(400, "invalid_request", f"action: one of {', '.join(ACTIONS)}")
            if body.get("decision") not in ("allow", "deny"):
                raise BodyError(400, "invalid_request", "decision: allow or deny")
            extra = attributes(body.get("attributes") or {})
            extra[PREFIX + "action"] = action
            extra[PREFIX + "name"] = _text(body.get("workspace"), "workspace")
            opt = {
                k: _text(body[k], k)
                for k in ("sandbox_id", "policy", "policy_hash", "reason", "message")
                if body.get(k) is not None
            }
        except BodyError as exc:
            return exc.response()
        event = build(
            EventKind.WORKSPACE,
            sandbox_id=opt.get("sandbox_id"),
            decision=body["decision"],
            reason=opt.get("reason"),
            message=opt.get("message"),
            policy_name=opt.get("policy"),
            policy_hash=opt.get("policy_hash"),
            extra=extra,
        )
        try:
            await self.rt.audit.write(event)
        except AuditUnavailable:
            return error_response(
                503,
                "audit_unavailable",
                "the workspace record could not be written; the run refuses to go on without it",
            )
        return web.json_response({"recorded": True, "request_id": event.request_id})

    async def write(self, request: web.Request) -> web.Response:
        """A pending `persistent_write` approval for a run's staged changes (one per workspace)."""
        try:
            body = await read_object(request)
            if set(body) - {
                "sandbox_id",
                "workspace",
                "changes",
                "manifest_hash",
                "base_manifest_hash",
                "pending_ttl_seconds",
            }:
                raise BodyError(
                    400,
                    "invalid_request",
                    "keys: sandbox_id, workspace, changes, manifest_hash, base_manifest_hash, pending_ttl_seconds",
                )
            sandbox_id = _text(body.get("sandbox_id"), "sandbox_id", 64)
            workspace = _text(body.get("workspace"), "workspace")
            listed = changes(body.get("changes"))
            ttl = body.get("pending_ttl_seconds", int(PENDING_TTL_SECONDS))
            if type(ttl) is not int or not 1 <= ttl <= MAX_FOR_SECONDS:
                raise BodyError(400, "invalid_request", f"pending_ttl_seconds: an integer 1..{MAX_FOR_SECONDS}")
            hashes = {k: _text(body.get(k), k, 80) for k in ("manifest_hash", "base_manifest_hash")}
        except BodyError as exc:
            return exc.response()
        try:
            record = await self.rt.state.get(sandbox_id)
        except StateUnavailable:
            return error_response(503, "state_unavailable", "the state store did not answer")
        if record is None:
            return error_response(404, "unknown_sandbox", f"no sandbox {sandbox_id!r} was admitted")
        now = self.rt.clock()
        draft = Approval(
            id=new_approval_id(),
            sandbox_id=sandbox_id,
            policy=record.policy_name,
            state=ApprovalState.PENDING,
            scheme="workspace",
            host=f"workspace:{workspace}",
            port=0,
            method="write",
            path=None,
            requested_at=now,
            kind=KIND_PERSISTENT_WRITE,
            pending_ttl=float(ttl),
            details={"workspace": workspace, "count": len(listed), "changes": listed, **hashes},
        )
        try:
            await self.rt.audit.write(approval_event(draft, "requested", dict(record.labels)))
        except AuditUnavailable:
            return error_response(503, "audit_unavailable", "the approval could not be recorded")
        try:
            approval, created = await self.rt.approvals.request(draft, now)
        except StateUnavailable:
            return error_response(503, "state_unavailable", "the approval store did not answer")
        if approval is None or not created:
            return error_response(
                409,
                "write_not_staged",
                f"workspace {workspace} already has a pending write "
                f"({approval.id if approval else 'too many pending approvals'})",
            )
        return web.json_response(approval.to_json(), status=201)


async def settle_write(rt: Runtime, approval: Approval) -> None:
    """Apply or discard a decided/expired persistent write on this host's var dir (if it is here) and record
    what happened; a failure is logged and recorded, and left to the runtime side to finish."""
    from egressgate.runtimes.workspaces import WorkspaceError, settle

    outcome = str(approval.state)
    try:
        attrs = await asyncio.to_thread(settle, Path(rt.config.var_dir), approval.id, outcome, approval.decided_by)
    except (OSError, WorkspaceError) as exc:
        logger.error("persistent write %s: %s", approval.id, exc)
        attrs = {"approval_id": approval.id, "outcome": outcome, "error": str(exc)[:MAX_STR]}
        action = None
    else:
        if attrs is None:
            return  # not on this host, or already settled
        action = attrs.pop("action")
    event = build(
        EventKind.WORKSPACE,
        sandbox_id=approval.sandbox_id,
        decision="allow" if action == "write_applied" else "deny",
        policy_name=approval.policy,
        extra={
            PREFIX + "action": action or "write_unsettled",
            **{PREFIX + k: v for k, v in attrs.items() if v is not None},
        },
    )
    rt.audit.enqueue_after(event)
