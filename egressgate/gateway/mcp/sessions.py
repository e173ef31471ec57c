"""Which MCP session a remote MCP request belongs to, and the per-flow record of an MCP exchange.

A session (egressgate/mcp/mediator.McpSession) holds what one MCP conversation has seen (the latest
tools/list hashes, the serverInfo, calls awaiting an answer); the decisions themselves read the
per-sandbox state store, so a new or unknown session is never a way around a pin or a budget.

Keys:
- streamable HTTP: (sandbox, server, Mcp-Session-Id). A POST without the header (the initialize) uses
  the sandbox's "no id yet" session, which moves to the id the server's answer assigns; a stateless
  server never assigns one and keeps that session. An id the gateway does not know (a gateway restart)
  gets a fresh session: the server is the one that refuses unknown ids. An id the server gave to ANOTHER
  sandbox is refused (it would let one sandbox speak in another's server-side session).
- the older HTTP+SSE transport: one session per SSE stream (GET of the server's url), reachable by the
  message endpoint its `endpoint` event announced — (sandbox, server, path, query) exactly. A POST to an
  endpoint no stream of THIS sandbox announced is refused: it is someone else's session or a guess.

Bounded: at most MAX_SESSIONS_PER_SANDBOX live sessions per sandbox; the oldest is closed (its calls
without an answer are recorded `no_response` by the mediator) when another opens.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from egressgate.gateway.mcp.stream import Injector
    from egressgate.policy.mcp_compile import McpServer

logger = logging.getLogger(__name__)

MAX_SESSIONS_PER_SANDBOX = 32
MAX_SESSION_IDS = 65536  # session ids remembered with their sandbox (gateway-wide)

# (sandbox id, server name, session key): the key is the Mcp-Session-Id (None before one is assigned) or,
# for the HTTP+SSE transport, the stream's own id
SessionKey = tuple[str, str, Any]


@dataclass(slots=True)
class McpExchange:
    """One flow on an MCP route (FlowState.mcp): what mcp/route.py decided for it and what its
    response stream needs. Written by McpRoute only."""

    server: McpServer
    role: str  # "post" (JSON-RPC messages), "stream" (server-to-client SSE), "delete", "other"
    key: SessionKey | None = None
    session: Any = None  # the McpSession (egressgate/mcp/mediator.py)
    replies: list[dict] = field(default_factory=list)  # gateway answers to merge into the response
    batch: bool = False  # the client's body was a JSON array: answer with one
    answered: bool = False  # the gateway answered this flow itself (nothing to filter)
    injector: Injector | None = None  # HTTP+SSE transport: the stream this POST's answers travel on
    ping_id: str | None = None  # ... and the gateway ping standing in for a fully denied POST
    ticket: Any = None  # streamable HTTP POST: the requests it forwarded (mediator.Ticket), freed when it ends
    status: int | None = None  # the upstream's HTTP status for this POST
    # the request's MCP-Protocol-Version header: the session's version when no initialize was seen (a
    # gateway restart), for the batch check (mcp/methods.py)
    protocol_header: str | None = None
    held: Any = None  # mediator HeldOutcome: the folded call's outcome, written into this POST's outcome


@dataclass(slots=True)
class _Entry:
    session: Any
    injector: Injector | None = None
    endpoint: tuple[str, str] | None = None  # HTTP+SSE transport: (path, query) announced


class McpSessions:
    """The live sessions of every sandbox (one table per gateway process)."""

    def __init__(self) -> None:
        self._by_sandbox: dict[str, OrderedDict[SessionKey, _Entry]] = {}
        self._endpoints: dict[tuple[str, str, str, str], SessionKey] = {}  # (sbx, server, path, query)
        self._closing: set[asyncio.Task] = set()
        # (server, Mcp-Session-Id) -> the sandbox the server's answer gave it to: a session id is the key to
        # a server-side conversation, so another sandbox presenting it is refused (bounded, oldest dropped)
        self._owners: OrderedDict[tuple[str, str], str] = OrderedDict()

    def assign(self, server: str, session_id: str, sandbox_id: str) -> None:
        """The server's answer to `sandbox_id` carried `session_id` (the first owner stays the owner)."""
        key = (server, session_id)
        if key not in self._owners:
            self._owners[key] = sandbox_id
            while len(self._owners) > MAX_SESSION_IDS:
                self._owners.popitem(last=False)

    def owner(self, server: str, session_id: str) -> str | None:
        return self._owners.get((server, session_id))

    def get(self, key: SessionKey) -> Any | None:
        entry = self._by_sandbox.get(key[0], {}).get(key)
        return entry.session if entry is not None else None

    def put(self, key: SessionKey, session: Any, injector: Injector | None = None) -> None:
        table = self._by_sandbox.setdefault(key[0], OrderedDict())
        table[key] = _Entry(session, injector)
        table.move_to_end(key)
        while len(table) > MAX_SESSIONS_PER_SANDBOX:
            old_key, _ = next(iter(table.items()))
            self._drop(old_key)

    def rekey(self, old: SessionKey, new: SessionKey) -> None:
        """The server assigned the session its id (streamable HTTP initialize answer)."""
        table = self._by_sandbox.get(old[0])
        entry = table.pop(old, None) if table is not None else None
        if entry is None or old == new:
            if entry is not None and table is not None:
                table[old] = entry
            return
        if new in table:
            self._drop(new)
        table[new] = entry

    def announce(self, key: SessionKey, path: str, query: str) -> None:
        """An HTTP+SSE stream announced its message endpoint."""
        entry = self._by_sandbox.get(key[0], {}).get(key)
        if entry is None:
            return
        if entry.endpoint is not None:
            self._endpoints.pop((key[0], key[1], *entry.endpoint), None)
        entry.endpoint = (path, query)
        self._endpoints[(key[0], key[1], path, query)] = key

    def by_endpoint(self, sandbox_id: str, server: str, path: str, query: str) -> tuple[Any, Injector] | None:
        key = self._endpoints.get((sandbox_id, server, path, query))
        entry = self._by_sandbox.get(sandbox_id, {}).get(key) if key is not None else None
        if entry is None or entry.injector is None:
            return None
        return entry.session, entry.injector

    async def close_all(self) -> None:
        """The gateway stops: every session ends (calls still unanswered are recorded `no_response`)."""
        for table in list(self._by_sandbox.values()):
            for key in list(table):
                self._drop(key)
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    def end(self, key: SessionKey) -> None:
        """The session ended (DELETE answered, SSE stream closed)."""
        self._drop(key)

    def _drop(self, key: SessionKey) -> None:
        table = self._by_sandbox.get(key[0])
        entry = table.pop(key, None) if table is not None else None
        if table is not None and not table:
            self._by_sandbox.pop(key[0], None)
        if entry is None:
            return
        if entry.endpoint is not None:
            self._endpoints.pop((key[0], key[1], *entry.endpoint), None)
        close = getattr(entry.session, "close", None)
        if close is None:
            return
        task = asyncio.get_running_loop().create_task(close(), name="mcp-session-close")
        self._closing.add(task)
        task.add_done_callback(self._closed)

    def _closed(self, task: asyncio.Task) -> None:
        self._closing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("closing an MCP session failed: %r", task.exception())
