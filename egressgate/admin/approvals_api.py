"""The approvals part of the control API (docs/openapi.yaml, docs/operations.md "Approvals").

  GET  /v1/approvals[?state=pending|approved|denied|expired]
  GET  /v1/approvals/{id}
  POST /v1/approvals/{id}/approve  {"for_seconds": 1..86400 (600), "scope": "host"|"host+path", "by": str}
  POST /v1/approvals/{id}/deny     {"by": str}

An approval widens one sandbox's allowlist, so its record is durable before it takes effect (the audit
sink refuses: 503, nothing changes), like an admission; a sandbox that was revoked (or is unknown) gets
nothing (409). Also runs the expiry sweeper for as long as the admin server runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from egressgate.admin.errors import error_response as _error
from egressgate.admin.jsonbody import BodyError, read_object
from egressgate.approvals.audit import approval_event
from egressgate.approvals.grant import SCOPE_HOST, SCOPES
from egressgate.approvals.model import (
    DEFAULT_FOR_SECONDS,
    KIND_PERSISTENT_WRITE,
    MAX_BY_CHARS,
    MAX_FOR_SECONDS,
    Approval,
    ApprovalNotFound,
    ApprovalState,
    NotPending,
    valid_approval_id,
)
from egressgate.approvals.sweeper import sweep_forever
from egressgate.audit.event import AuditUnavailable
from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.admin.server import AdminServer

logger = logging.getLogger(__name__)


def register_approvals(server: AdminServer) -> None:
    """Routes and the expiry sweeper (started and stopped with the admin server's aiohttp app)."""
    api = ApprovalsApi(server)
    router = server.app.router
    router.add_get("/v1/approvals", api.list)
    router.add_get("/v1/approvals/{approval_id}", api.show)
    router.add_post("/v1/approvals/{approval_id}/approve", api.approve)
    router.add_post("/v1/approvals/{approval_id}/deny", api.deny)
    server.app.cleanup_ctx.append(api.sweeper)


def _brief(approval: dict) -> dict:
    """The list's form: a persistent write's change list (up to 100,000 paths) only in GET /v1/approvals/{id}
    (the console polls the list every few seconds)."""
    details = approval.get("details")
    if isinstance(details, dict) and "changes" in details:
        approval["details"] = {k: v for k, v in details.items() if k != "changes"}
    return approval


def _unavailable() -> web.Response:
    return _error(503, "state_unavailable", "the approval store did not answer; retry when /readyz is ready")


class ApprovalsApi:
    def __init__(self, server: AdminServer) -> None:
        self.rt = server.rt

    async def sweeper(self, _app: web.Application):
        task = asyncio.create_task(sweep_forever(self.rt.approvals, self.rt.audit, self.rt.clock,
                                                 on_expired=self._settled, labels_of=self._labels),
                                   name="approval-sweeper")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def list(self, request: web.Request) -> web.Response:
        raw = request.query.get("state")
        if set(request.query) - {"state"} or (raw is not None and raw not in set(ApprovalState)):
            return _error(400, "invalid_request", "query: state=pending|approved|denied|expired")
        try:
            found = await self.rt.approvals.list(ApprovalState(raw) if raw else None, self.rt.clock())
        except StateUnavailable:
            return _unavailable()
        found.sort(key=lambda a: a.requested_at, reverse=True)  # newest first
        return web.json_response({"approvals": [_brief(a.to_json()) for a in found]})

    async def show(self, request: web.Request) -> web.Response:
        if not valid_approval_id(request.match_info["approval_id"]):
            return _error(404, "not_found", "no approval with this id")
        try:
            approval = await self.rt.approvals.get(request.match_info["approval_id"])
        except StateUnavailable:
            return _unavailable()
        if approval is None:
            return _error(404, "not_found", "no approval with this id")
        return web.json_response(approval.current(self.rt.clock()).to_json())

    async def _body(self, request: web.Request, keys: set[str]) -> dict:
        body = await read_object(request) if request.can_read_body else {}
        if set(body) - keys:
            raise BodyError(400, "invalid_request", f"keys: {', '.join(sorted(keys))}")
        by = body.get("by")
        if by is not None and (not isinstance(by, str) or not 0 < len(by) <= MAX_BY_CHARS):
            raise BodyError(400, "invalid_request", f"by: a string of 1..{MAX_BY_CHARS} characters")
        return body

    async def approve(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, {"for_seconds", "scope", "by"})
        except BodyError as exc:
            return exc.response()
        seconds = body.get("for_seconds", DEFAULT_FOR_SECONDS)
        if type(seconds) is not int or not 1 <= seconds <= MAX_FOR_SECONDS:
            return _error(400, "invalid_request", f"for_seconds: an integer 1..{MAX_FOR_SECONDS}")
        scope = body.get("scope", SCOPE_HOST)
        if scope not in SCOPES:
            return _error(400, "invalid_request", "scope: host or host+path")
        return await self._decide(request, approve=True, by=body.get("by"), scope=scope, seconds=seconds)

    async def deny(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, {"by"})
        except BodyError as exc:
            return exc.response()
        return await self._decide(request, approve=False, by=body.get("by"), scope=SCOPE_HOST, seconds=1)

    async def _decide(self, request: web.Request, *, approve: bool, by: str | None, scope: str,
                      seconds: int) -> web.Response:
        approval_id = request.match_info["approval_id"]
        if not valid_approval_id(approval_id):
            return _error(404, "not_found", "no approval with this id")
        now = self.rt.clock()
        store = self.rt.approvals
        try:
            approval = await store.get(approval_id)
            if approval is None:
                return _error(404, "not_found", "no approval with this id")
            if approval.current(now).state is not ApprovalState.PENDING:
                return _error(409, "not_pending", f"approval {approval_id} is {approval.current(now).state}")
            record = await self.rt.state.get(approval.sandbox_id)
        except StateUnavailable:
            return _unavailable()
        # a persistent write is about the workspace its (ended, revoked) run left, not the sandbox's authority
        if approve and approval.kind != KIND_PERSISTENT_WRITE and (record is None or record.revoked):
            return _error(409, "not_pending", f"sandbox {approval.sandbox_id} was revoked; nothing can be granted "
                          "to it")
        try:
            decided = approval.decided(approve=approve, by=by, scope=scope, for_seconds=seconds, now=now)
        except ValueError as exc:
            return _error(400, "invalid_request", str(exc))
        action = "approved" if approve else "denied"
        labels = record.labels if record is not None else None
        if not await self._audit(decided, action, labels):  # intent before effect
            return _error(503, "audit_unavailable", "the decision could not be recorded, so it was not applied")
        try:
            applied = await store.decide(approval_id, approve=approve, by=by, scope=scope, for_seconds=seconds,
                                         now=now)
        except (ApprovalNotFound, NotPending):
            # another operator or replica decided first: say that the record above did not take effect
            self.rt.audit.enqueue_after(approval_event(decided, "not_applied", labels))
            return _error(409, "not_pending", f"approval {approval_id} was decided by someone else")
        except StateUnavailable:
            self.rt.audit.enqueue_after(approval_event(decided, "not_applied", labels))
            return _unavailable()
        await self._settled(applied)
        return web.json_response(applied.to_json())

    async def _settled(self, approval: Approval) -> None:
        """A decided or expired persistent write is applied or discarded now (admin/workspaces_api.py)."""
        if approval.kind == KIND_PERSISTENT_WRITE:
            from egressgate.admin.workspaces_api import settle_write

            await settle_write(self.rt, approval)

    async def _labels(self, sandbox_id: str) -> dict[str, str] | None:
        """The sandbox's labels for an `expired` record (None: gone, or the registry did not answer)."""
        try:
            record = await self.rt.state.get(sandbox_id)
        except StateUnavailable:
            return None
        return dict(record.labels) if record is not None else None

    async def _audit(self, approval: Approval, action: str, labels: dict[str, str] | None) -> bool:
        try:
            await self.rt.audit.write(approval_event(approval, action, labels))
            return True
        except AuditUnavailable:
            return False
