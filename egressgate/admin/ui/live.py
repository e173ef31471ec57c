"""`GET /ui/api/live`: every audit record this process writes, as server-sent events, within a second.

The tap sits on the audit sink's write path (audit/observe.py, the same tap /metrics uses, so every
writer - proxy addons, DNS resolver, admin API - goes through it).
It must never slow the gateway or hold memory for a slow browser:

* with no client connected, a record costs one truth test;
* each client has a bounded queue (QUEUE_MAX); the tap only ever `put_nowait`s. A client whose queue is
  full is dropped (its stream ends with `event: dropped`), the gateway never waits for it;
* the summary of a record is built once per record (only when some client wants it), JSON-encoded in
  the client's own task;
* at most MAX_CLIENTS streams per process (503 beyond).

A `write` is observed once it returned (durable); `write_after`/`enqueue_after` records are never dropped
by the sink, so they are observed at once (audit/observe.py: the same rule as /metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from egressgate.admin.errors import error_response
from egressgate.admin.ui.auth import COOKIE
from egressgate.admin.ui.routes import CONSOLE_KEY, secure
from egressgate.audit.event import AuditEvent
from egressgate.audit.observe import observe_writes

logger = logging.getLogger(__name__)

QUEUE_MAX = 1000
MAX_CLIENTS = 32
KEEPALIVE_S = 15.0
SESSION_RECHECK_S = 5.0  # a stream ends within this long after its session is logged out or expires
FILTERS = ("sandbox", "host", "reason", "decision")
MAX_FILTER_CHARS = 256


def summary(event: AuditEvent) -> dict[str, Any]:
    """What the live table shows of a record (data only; the front end renders it as text)."""
    return {
        "time": datetime.fromtimestamp(event.time_ns / 1e9, UTC).isoformat(timespec="milliseconds"),
        "time_ns": event.time_ns, "kind": str(event.kind), "request_id": event.request_id,
        "request_hash": event.request_hash, "sandbox": event.sandbox_id, "labels": dict(event.sandbox_labels),
        "host": event.host, "port": event.port, "method": event.method, "path": event.path,
        "decision": event.decision, "reason": event.reason, "rule": event.rule_id, "status": event.status,
        # what an approval record did (requested, approved, denied, expired): those records carry no
        # allow/deny of their own for two of the four steps, and "—" told an operator nothing
        "action": event.extra.get("egressgate.approval.action"),
    }


class Client:
    __slots__ = ("ending", "filters", "queue", "session_id")

    def __init__(self, filters: dict[str, str], session_id: str | None = None) -> None:
        self.filters = filters
        self.session_id = session_id
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(QUEUE_MAX)
        self.ending: str | None = None  # why the stream ends: dropped, logout, shutdown

    @property
    def dropped(self) -> bool:
        return self.ending == "dropped"

    def end(self, why: str) -> None:
        """Make the stream end at its next wake-up (the None wakes it; a full queue wakes it anyway)."""
        self.ending = self.ending or why
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(None)

    def wants(self, event: AuditEvent) -> bool:
        f = self.filters
        return ((f.get("sandbox") is None or event.sandbox_id == f["sandbox"])
                and (f.get("host") is None or (event.host or "").lower() == f["host"])
                and (f.get("reason") is None or event.reason == f["reason"])
                and (f.get("decision") is None or event.decision == f["decision"]))


class LiveFeed:
    def __init__(self, sink: Any) -> None:
        self.clients: set[Client] = set()
        self.written = True  # a record was written since the audit index last caught up (audit_api.py)
        observe_writes(sink, "console_live", self.observe)  # swaps, never taps twice (audit/observe.py)

    def observe(self, event: AuditEvent) -> None:
        """On the event loop, for every record: never blocks, never raises into the writer."""
        self.written = True
        if not self.clients:
            return
        data: dict[str, Any] | None = None
        for client in tuple(self.clients):
            try:
                if not client.wants(event):
                    continue
                if data is None:
                    data = summary(event)
                client.queue.put_nowait(data)
            except asyncio.QueueFull:
                # O(1): the full queue is let go (its records freed; the stream's task cannot be waiting on
                # a full queue, it is busy writing), a fresh one holds only the end
                client.ending = "dropped"
                client.queue = asyncio.Queue(1)
                client.queue.put_nowait(None)
                self.clients.discard(client)
            except Exception:  # a bug here must never fail an audit write
                logger.exception("console live feed: dropping a client")
                client.end("dropped")
                self.clients.discard(client)

    async def close_all(self, _app: web.Application | None = None) -> None:
        """On shutdown: end every stream."""
        for client in tuple(self.clients):
            self.clients.discard(client)
            client.end("shutdown")

    def end_session(self, session_id: str | None) -> None:
        """Logout in this process ends that session's streams at once (other processes: SESSION_RECHECK_S)."""
        for client in tuple(self.clients):
            if session_id is not None and client.session_id == session_id:
                self.clients.discard(client)
                client.end("logout")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """`event: ready` once subscribed, then `event: record` per matching record; `: keepalive` every
        15 s; `event: dropped` (and the end) when this client fell QUEUE_MAX records behind;
        `event: logout` (and the end) once the session is gone (logout anywhere, expiry)."""
        filters: dict[str, str] = {}
        for key, value in request.query.items():
            if key not in FILTERS or key in filters or len(value) > MAX_FILTER_CHARS:
                return error_response(400, "invalid_request", f"query parameters (each once, at most "
                                      f"{MAX_FILTER_CHARS} characters): {', '.join(FILTERS)}")
            if value:
                filters[key] = value.lower() if key == "host" else value
        if filters.get("decision") not in (None, "allow", "deny"):
            return error_response(400, "invalid_request", "decision: allow or deny")
        if len(self.clients) >= MAX_CLIENTS:
            return error_response(503, "too_many_streams", f"at most {MAX_CLIENTS} live streams at once; close "
                                  "another console tab")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "X-Accel-Buffering": "no"})
        secure(response.headers)
        sessions, session_id = request.app[CONSOLE_KEY].sessions, request.cookies.get(COOKIE)
        client = Client(filters, session_id)
        checked = time.monotonic()
        self.clients.add(client)
        try:
            await response.prepare(request)
            await response.write(b"event: ready\ndata: {}\n\n")
            while True:
                try:
                    item = await asyncio.wait_for(client.queue.get(), min(KEEPALIVE_S, SESSION_RECHECK_S))
                except TimeoutError:
                    item = False
                if time.monotonic() - checked >= SESSION_RECHECK_S:
                    checked = time.monotonic()
                    if sessions.get(session_id) is None:
                        client.end("logout")  # logged out in another process, or expired
                if client.ending is not None:
                    if client.ending != "shutdown":
                        await response.write(f"event: {client.ending}\ndata: {{}}\n\n".encode())
                    break
                if item is False:
                    await response.write(b": keepalive\n\n")
                    continue
                if item is None:
                    break
                await response.write(b"event: record\ndata: " + json.dumps(item, ensure_ascii=True).encode()
                                     + b"\n\n")
        except ConnectionError:  # the browser went away
            return response
        finally:
            self.clients.discard(client)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response
