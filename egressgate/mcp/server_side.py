"""The server's half of a session: what its answers to `initialize` and `tools/list` pin and show.

- initialize: the answer's serverInfo (name, version) is this session's `server_info_now`. On the
  2026-07-28 protocol there is no initialize (`server/discover`, the SDK client's default mode): the
  serverInfo stamp in the `_meta` of the discover and tools/list answers is, so a modern client neither
  skips a trust-on-first-use pin nor is refused by a policy pin it matches. With a pin in the policy
  it is compared there; otherwise (trust on first use) the first one ever seen for this sandbox and
  server is recorded in the state store (set-if-absent) and later ones are compared with it.
  A difference is recorded (`mcp_message`, reason mcp_server_changed); the engine then denies calls.
- tools/list: every allowed tool's hash (mcp/schema.py, the WHOLE tool object) is compared with its pin
  or, on first sight, recorded. The answer the client sees lists only tools a call could be allowed for:
  not denied, allowed by the policy, not drifted (the client is not offered a changed tool it would only
  be refused). An answer that is not a list of uniquely named tools is replaced by an error (which of
  two same-named tools would a call run?). Changes are recorded (`mcp_tools_list`).

Synchronous on purpose (`handle_nowait`): a gateway's response stream cannot await (mitmproxy's
`flow.response.stream` is a plain callable), so answers are filtered at once against the policy's pins
and the pins this session last read from the store (`known`, refreshed by the session before it
forwards an initialize/tools/list and at every call decision); the store writes (first sights) and their
records run as scheduled effects that the session awaits (`settle`) before it decides anything next.
The filter is what the client is shown; the call decision is what is enforced, and it always reads the
pins from the store: a first sight another session recorded a moment earlier still denies the call.
A pin that cannot be written (store down) marks the session: its calls are denied state_unavailable (a
first sight that was not recorded could not be enforced later).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from egressgate.mcp import records
from egressgate.mcp.jsonrpc import INVALID_REQUEST, Message, deny_error
from egressgate.mcp.schema import server_info, stamped_server_info, tool_hash, tools_of
from egressgate.policy.mcp_decide import visible_tools
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.mcp.mediator import McpSession

logger = logging.getLogger(__name__)
TRACKED = ("initialize", "server/discover", "tools/list")
SERVER_INFO_PIN = "server_info"
TOOL_PIN = "tool:"


class ServerSide:
    def __init__(self, session: McpSession) -> None:
        self.session = session
        self.expected: dict[int | str, str] = {}  # client request id -> method, for answers we read
        self.server_info_now: tuple[str, str] | None = None
        self.tool_hashes: dict[str, str] = {}  # tool -> hash in this session's latest tools/list
        self.known: dict[str, str] = {}  # pins of this sandbox+server as last read from the store
        self.pin_failed = False
        self._effects: list[Awaitable[None]] = []

    def expect(self, msg: Message) -> bool:
        """Remember a client request whose answer is read here; True when it is one."""
        if msg.method in TRACKED and msg.id is not None:
            self.expected[msg.id] = msg.method
            return True
        return False

    async def refresh(self) -> None:
        # on failure the filter keeps the last pins read; every call decision reads them again (fail closed)
        with contextlib.suppress(StateUnavailable):
            self.known = await self.session.rt.state.mcp_pins(self.session.sandbox_id, self.session.server_name)

    async def settle(self) -> None:
        """Await every scheduled effect (first-sight pins and their records)."""
        while self._effects:
            effect = self._effects.pop(0)
            try:
                await effect
            except Exception:  # a failed effect must not pass unnoticed: the session's calls are refused
                logger.exception("mcp: a pin effect of session %s/%s failed", self.session.sandbox_id,
                                 self.session.server_name)
                self.pin_failed = True

    def _schedule(self, effect: Awaitable[None]) -> None:
        try:
            self._effects.append(asyncio.get_running_loop().create_task(effect))  # type: ignore[arg-type]
        except RuntimeError:  # no loop running in this thread: settle() runs it
            self._effects.append(effect)

    def handle_nowait(self, msg: Message) -> dict:
        if msg.kind != "response" or msg.id not in self.expected:
            return msg.obj
        method = self.expected.pop(msg.id)  # type: ignore[arg-type]
        if msg.error is not None:
            return msg.obj
        if method == "initialize":
            version = msg.result.get("protocolVersion") if isinstance(msg.result, dict) else None
            self.session.protocol_version = version if isinstance(version, str) else None  # methods.py: batches
            self._initialize(server_info(msg.result))
            return msg.obj
        stamp = stamped_server_info(msg.result)
        if stamp is not None or method == "server/discover":
            self._initialize(stamp)
        return msg.obj if method == "server/discover" else self._tools_list(msg)

    def _server(self) -> Any:
        policy = self.session.current_policy()
        return None if policy is None else policy.mcp.servers.get(self.session.server_name)

    def _record(self, **kw: Any) -> None:
        self.session.rt.audit.enqueue_after(records.message_record(self.session.ctx, **kw))

    async def _first_sight(self, name: str, value: str, on_differs) -> None:
        """Record `value` unless a first sight is stored; `on_differs(stored)` when the stored one differs."""
        try:
            stored = await self.session.rt.state.mcp_pin(self.session.sandbox_id, self.session.server_name,
                                                         name, value)
        except StateUnavailable:
            self.pin_failed = True
            self._record(reason=str(Reason.STATE_UNAVAILABLE), detail="pin_not_recorded", message=(
                "The gateway could not record the MCP server's pins; this session's tool calls are refused."))
            return
        self.known[name] = stored
        if stored != value:
            on_differs(stored)

    def _initialize(self, info: tuple[str, str] | None) -> None:
        self.server_info_now = info
        server = self._server()
        if server is None:
            return
        shown = list(info) if info is not None else []
        if server.server_info is not None:
            if info != server.server_info:
                self._record(reason=str(Reason.MCP_SERVER_CHANGED), detail="server_info_pin", message=(
                    f"MCP server {server.name!r} reports {shown} instead of its pin {list(server.server_info)}."),
                    extra={records.SERVER_INFO: shown})
            return
        if not server.trust_on_first_use or info is None:
            return
        value = json.dumps(shown)

        def changed(seen: str) -> None:
            self._record(reason=str(Reason.MCP_SERVER_CHANGED), detail="server_info_tofu", message=(
                f"MCP server {server.name!r} reports {shown}; this sandbox first saw {seen}."),
                extra={records.SERVER_INFO: shown})

        seen = self.known.get(SERVER_INFO_PIN)
        if seen is None:
            self._schedule(self._first_sight(SERVER_INFO_PIN, value, changed))
        elif seen != value:
            changed(seen)

    def _tools_list(self, msg: Message) -> dict:
        tools = tools_of(msg.result)
        if tools is None:
            self._record(reason=str(Reason.MCP_MALFORMED), detail="server_tools_list", message=(
                "The MCP server's tools/list answer is not a list of uniquely named tools; it was refused."))
            return deny_error(msg.id, "The MCP server's tools/list answer was refused by the gateway (not a list of "
                              "uniquely named tools).", str(Reason.MCP_MALFORMED), None, code=INVALID_REQUEST)
        server = self._server()
        hashes = {t["name"]: tool_hash(t) for t in tools}
        changed = {n for n, h in hashes.items() if n in self.tool_hashes and self.tool_hashes[n] != h}
        self.tool_hashes.update(hashes)
        if server is None:
            return {**msg.obj, "result": {**msg.result, "tools": []}}
        drifted: set[str] = set()
        first: dict[str, str] = {}
        for name, digest in hashes.items():
            if name not in server.allowed:
                continue
            pin = server.tool_schemas.get(name)
            if pin is None and server.trust_on_first_use:
                pin = self.known.get(TOOL_PIN + name)
                if pin is None:
                    first[name] = digest
                    continue
            if pin is not None and pin != digest:
                drifted.add(name)
        visible = visible_tools(self.session.policy, server.name, tools, frozenset(drifted))
        visible_names = [t["name"] for t in visible]
        if drifted or changed:
            self._drift_record(hashes, changed, drifted, visible_names)
        for name, digest in first.items():
            self._schedule(self._first_sight(
                TOOL_PIN + name, digest,
                lambda _seen, name=name: self._drift_record(hashes, changed, {name}, visible_names)))
        return {**msg.obj, "result": {**msg.result, "tools": visible}}

    def _drift_record(self, hashes: dict[str, str], changed: set[str], drifted: set[str], visible: list[str]) -> None:
        self.session.rt.audit.enqueue_after(records.tools_list_record(
            self.session.ctx, hashes=hashes, changed=changed, drifted=drifted, visible=visible))
