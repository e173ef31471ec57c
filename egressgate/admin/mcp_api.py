"""The local-MCP part of the control API: what `egressgate mcp run` (egressgate/mcp/local.py) asks.

  POST   /v1/mcp/local-start                               {"policy", "server", "labels"?}
  POST   /v1/sandboxes/{id}/mcp/{server}/messages?direction=to_server|to_client   body: one stdio line
  DELETE /v1/sandboxes/{id}/mcp/{server}                   the relay ended: end the session

The relay outside the sandbox carries lines; the decisions, budgets, pins, approvals and audit records
are the gateway's: one McpSession (egressgate/mcp/mediator.py) per (sandbox, server), the same mediator
the remote transport uses. A message body is the line's raw bytes (not a JSON string): the strict parser
must see exactly the bytes the other side would parse (a BOM, invalid UTF-8, an escaped surrogate), which a
JSON string re-encoding by the relay would have changed.

Rules enforced here (each once):
* a local MCP server starts only if its policy has `execution.local_mcp_servers: allow` AND names it in
  `mcp.servers` with `local: true` (`local_refusal`); a refusal is audited (an `admission` record,
  decision deny, reason mcp_local_denied) and answered 403 with one sentence;
* the same rule is checked again on every message, against the policy in force now (a reload that
  withdraws the permission ends the session: 403, audited);
* a revoked or unknown sandbox gets 410/404 and its sessions are dropped: the relay then kills the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from aiohttp import web

from egressgate.admin.errors import error_response, state_unavailable
from egressgate.admin.jsonbody import BodyError, read_object
from egressgate.audit.build import DETAIL, build
from egressgate.audit.event import EventKind
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.admin.server import AdminServer


DIRECTIONS = ("to_server", "to_client")
SWEEP_SECONDS = 10.0  # sessions of revoked sandboxes whose relay never said goodbye (SIGKILL) are ended
MCP_SERVER_ATTR = "egressgate.mcp.server"
MCP_LOCAL_ATTR = "egressgate.mcp.local"


def register_mcp(server: AdminServer) -> None:
    api = server.mcp = McpApi(server)  # type: ignore[attr-defined]  # tests reach the session table
    router = server.app.router
    router.add_post("/v1/mcp/local-start", api.local_start)
    router.add_post("/v1/sandboxes/{sandbox_id}/mcp/{server}/messages", api.messages)
    router.add_delete("/v1/sandboxes/{sandbox_id}/mcp/{server}", api.end)
    server.app.cleanup_ctx.append(api.sweeper)


def local_refusal(policy: Any, server: str) -> tuple[str, str] | None:
    """(one actionable sentence, detail) when `policy` may not start the local MCP server `server`; the
    rule itself is the pure engine's (policy/mcp_decide.decide_local_start)."""
    from egressgate.policy.mcp_decide import decide_local_start

    decision = decide_local_start(policy, server)
    return None if decision.decision == "allow" else (decision.message, decision.detail or "")


class McpApi:
    def __init__(self, server: AdminServer) -> None:
        self.rt = server.rt
        self.sessions: dict[tuple[str, str], Any] = {}  # (sandbox id, server) -> McpSession

    async def _refuse(self, policy: Any, server: str, refusal: tuple[str, str], sandbox_id: str | None,
                      labels: dict[str, str]) -> web.Response:
        """Audit the refusal (queued and retried if the sink fails now: it is refused either way), 403."""
        message, detail = refusal
        event = build(EventKind.ADMISSION, sandbox_id=sandbox_id, sandbox_labels=labels, decision="deny",
                      reason=str(Reason.MCP_LOCAL_DENIED), message=message, policy_name=policy.name,
                      policy_hash=policy.hash, extra={MCP_SERVER_ATTR: server, MCP_LOCAL_ATTR: True, DETAIL: detail})
        await self.rt.audit.write_after(event)
        return error_response(403, "mcp_local_denied", message, reason=str(Reason.MCP_LOCAL_DENIED))

    async def local_start(self, request: web.Request) -> web.Response:
        """May `policy` start its local server `server`? 200 with the line limit, or 403 (audited)."""
        try:
            body = await read_object(request)
        except BodyError as exc:
            return exc.response()
        if set(body) - {"policy", "server", "labels"}:
            return error_response(400, "invalid_request", "keys: policy, server, labels")
        name, server, labels = body.get("policy"), body.get("server"), body.get("labels") or {}
        if not isinstance(name, str) or not name or not isinstance(server, str) or not server:
            return error_response(400, "invalid_request", "policy and server are required strings")
        if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in labels.items()):
            return error_response(400, "invalid_request", "labels: string map")
        policy = self.rt.policies.get(name)
        if policy is None:
            return error_response(404, "unknown_policy", f"no policy named {name!r}",
                                  policies=sorted(self.rt.policies.policies))
        refusal = local_refusal(policy, server)
        if refusal is not None:
            return await self._refuse(policy, server, refusal, None, labels)
        return web.json_response({"policy": name, "server": server, "policy_hash": policy.hash,
                                  "max_message_bytes": policy.model.mcp.max_message_bytes})

    async def _session(self, sandbox_id: str, server: str) -> tuple[Any, Any, web.Response | None]:
        """(session, policy in force, None): the live session of (sandbox, server), created on first use;
        or (None, None, the response that refuses)."""
        try:
            record = await self.rt.state.get(sandbox_id)
        except StateUnavailable:
            return None, None, state_unavailable()
        if record is None:
            await self._drop(sandbox_id, server)
            return None, None, error_response(404, "unknown_sandbox", f"no sandbox {sandbox_id!r} was admitted")
        if record.revoked:
            await self._drop(sandbox_id, server)
            return None, None, error_response(410, "sandbox_revoked", f"sandbox {sandbox_id} was revoked; its MCP "
                                        "session ended")
        policy = self.rt.policies.get(record.policy_name)
        if policy is None:
            return None, None, error_response(409, "policy_unavailable", f"the policy {record.policy_name!r} of "
                                        f"sandbox {sandbox_id} is not in the active set")
        refusal = local_refusal(policy, server)
        if refusal is not None:
            await self._drop(sandbox_id, server)
            return None, None, await self._refuse(policy, server, refusal, sandbox_id, dict(record.labels))
        session = self.sessions.get((sandbox_id, server))
        if session is None:
            from egressgate.mcp.mediator import McpSession
            from egressgate.policy.mcp_decide import local_server

            created = McpSession(self.rt, policy, local_server(policy, server), record, "stdio")
            session = self.sessions.setdefault((sandbox_id, server), created)  # a concurrent first use wins
        return session, policy, None

    async def messages(self, request: web.Request) -> web.Response:
        sandbox_id, server = request.match_info["sandbox_id"], request.match_info["server"]
        direction = request.query.get("direction")
        if set(request.query) - {"direction"} or direction not in DIRECTIONS:
            return error_response(400, "invalid_request", "query: direction=to_server|to_client")
        session, policy, refused = await self._session(sandbox_id, server)
        if refused is not None:
            return refused
        limit = policy.model.mcp.max_message_bytes
        length = request.content_length
        if length is None:
            return error_response(411, "length_required", "send the line with a Content-Length")
        if length > limit + 1:  # the relay cuts an oversized line at limit+1: this did not come from it
            return error_response(413, "message_too_large", f"a message line is at most {limit} bytes "
                                  "(mcp.max_message_bytes); the relay cuts longer ones at limit+1")
        line = await request.content.readexactly(length) if length else b""
        if direction == "to_server":
            verdict = await session.from_client(line)
            forward = verdict.forward
            replies = list(verdict.replies)
        else:  # a line that is not strict JSON-RPC is recorded and dropped by the session (forward None)
            forward, replies = await session.from_server_bytes(line), []
        return web.json_response({"forward": forward.decode("utf-8") if forward is not None else None,
                                  "replies": replies})

    async def _drop(self, sandbox_id: str, server: str) -> None:
        session = self.sessions.pop((sandbox_id, server), None)
        if session is not None and hasattr(session, "close"):
            await session.close()

    async def end(self, request: web.Request) -> web.Response:
        """The relay ended: unanswered calls are recorded by the session's close."""
        sandbox_id, server = request.match_info["sandbox_id"], request.match_info["server"]
        known = (sandbox_id, server) in self.sessions
        await self._drop(sandbox_id, server)
        if not known:
            return error_response(404, "not_found", f"no MCP session of sandbox {sandbox_id} with {server!r}")
        return web.json_response({"id": sandbox_id, "server": server, "ended": True})

    async def sweeper(self, _app: web.Application):
        """For as long as the admin server runs: end the sessions of sandboxes revoked (or gone) without a
        DELETE from their relay (a relay killed with SIGKILL, then `sandbox gc`), so their unanswered calls
        are recorded and the session table stays bounded by the live sandboxes. At shutdown every session
        is ended (its unanswered calls recorded)."""
        task = asyncio.create_task(self._sweep_forever(), name="mcp-session-sweeper")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for key in list(self.sessions):
            await self._drop(*key)

    async def _sweep_forever(self, interval: float = SWEEP_SECONDS) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.sweep()

    async def sweep(self) -> None:
        for sandbox_id, server in list(self.sessions):
            try:
                record = await self.rt.state.get(sandbox_id)
            except StateUnavailable:
                return  # next round
            if record is None or record.revoked:
                await self._drop(sandbox_id, server)
