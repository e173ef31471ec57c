"""Connection limits and deadlines for the proxy listener (`limits:` in the gateway config).

mitmproxy closes a client connection only after `tcp_timeout` of inactivity; a client that sends one
byte of its request headers now and then (slow loris), or stalls its TLS handshake, held a connection
and its buffers forever, and nothing bounded how many such connections one source could open. This
addon runs first in the chain and keeps, per client connection, one deadline for the phase in which the
gateway is waiting for the client:

  accept ──header_timeout──▶ request headers (CONNECT or plain request)
  CONNECT answered 2xx ──tls_handshake_timeout──▶ ClientHello ──tls_handshake_timeout──▶ handshake done
  handshake done ──header_timeout──▶ first request headers in the tunnel
  last response done ──keepalive_timeout──▶ next request headers

No deadline runs while a request is in flight, in a raw TCP relay or a WebSocket (mitmproxy's idle
timeout, `limits.idle_timeout`, covers those). When a deadline passes the connection is aborted and the
event audited (limit_audit.py); an idle kept-alive connection that expires with nothing buffered is
closed quietly, as any server closes idle keep-alive connections.

Before a connection has identified a sandbox it counts against its *source address*
(`max_pending_per_source`); the connection over the limit gets a 429 deny body and is closed. After
identification it counts against the sandbox (`max_connections_per_sandbox`, enforced by identity.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from mitmproxy import connection, http, tcp, tls
from mitmproxy.proxy import layer

from egressgate.gateway.layers.refuse import RefuseLayer
from egressgate.gateway.shared.context import Runtime, ensure_flow_state, flow_state, new_request_id
from egressgate.gateway.shared.deny import gateway_deny, raw_deny
from egressgate.gateway.shared.limit_audit import LimitAudit
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)


PHASE_HEADERS = "request_headers"
PHASE_TLS = "tls_handshake"
PHASE_KEEPALIVE = "keepalive"
_EARLY = 0.001  # asyncio runs a timer up to its clock resolution early; within this a deadline has passed


@dataclass(slots=True)
class _Conn:
    source: str
    deadline: float | None = None  # loop.time() by which the current phase must end (None: no deadline)
    phase: str = PHASE_HEADERS
    seconds: float = 0.0  # the configured timeout of `phase` (for the audit text)
    timer: asyncio.TimerHandle | None = None  # fires at `timer_at` <= deadline; re-armed if the deadline moved
    timer_at: float = 0.0
    in_flight: int = 0
    streaming: bool = False  # a WebSocket or raw TCP relay: only the idle timeout applies
    refused: str | None = None  # request id of a refusal by the per-source limit


class ConnGuard:
    """Addon (first in the chain). `pending_bytes(client_id)` tells whether the client has sent part of a
    next request (None: unknown) and `write_backlog(client_id)` how much of a response it has not read
    yet; both come from the master, which can see mitmproxy's layers and transports."""

    name = "connguard"

    def __init__(self, runtime: Runtime, pending_bytes: Callable[[str], int | None],
                 write_backlog: Callable[[str], int]) -> None:
        self.rt = runtime
        self.limits = runtime.config.limits
        self.pending_bytes = pending_bytes
        self.write_backlog = write_backlog
        self.conns: dict[str, _Conn] = {}
        self.pending: dict[str, set[str]] = {}  # source address -> ids of not yet identified connections
        self.audit = LimitAudit(runtime, self.limits.audit_per_second)
        runtime.header_overflow = self._header_overflow
        runtime.limit_audit = self.audit  # tls_limits.py

    # ------------------------------------------------------------------ accept and the per-source limit
    def client_connected(self, client: connection.Client) -> None:
        source = str(client.peername[0]) if client.peername else "unknown"
        conn = self.conns[client.id] = _Conn(source)
        ids = self.pending.setdefault(source, set())
        for cid in [c for c in ids if self._identified(c)]:
            ids.discard(cid)  # identified since: they count against their sandbox now
        limit = self.limits.max_pending_per_source
        if len(ids) >= limit:
            conn.refused = new_request_id()
            self.audit.record(Reason.CONNECTION_LIMIT, source,
                              f"{source} already has {len(ids)} connections that have not identified a sandbox "
                              f"(limits.max_pending_per_source = {limit}); refused",
                              request_id=conn.refused, extra={"egressgate.limit": "max_pending_per_source"})
        else:
            ids.add(client.id)
        # a refused connection is answered when its request arrives; a silent one is cut at this deadline
        self._arm(client.id, PHASE_HEADERS, self.limits.header_timeout)

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        """A refused connection gets the deny contract (429) and is closed; nothing else runs on it."""
        conn = self.conns.get(nextlayer.context.client.id)
        if conn is not None and conn.refused is not None and nextlayer.layer is None:
            decision = gateway_deny(Reason.CONNECTION_LIMIT, detail="max_pending_per_source")
            nextlayer.layer = RefuseLayer(nextlayer.context, raw_deny(decision, conn.refused))

    def client_disconnected(self, client: connection.Client) -> None:
        conn = self.conns.pop(client.id, None)
        if conn is None:
            return
        self._drop_timer(conn)
        ids = self.pending.get(conn.source)
        if ids is not None:
            ids.discard(client.id)
            if not ids:
                del self.pending[conn.source]

    def done(self) -> None:
        """Shutdown: write the last summary records (the gateway drains rt.background afterwards)."""
        for conn in self.conns.values():
            self._drop_timer(conn)
        self.audit.close()

    # ------------------------------------------------------------------ phase changes
    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._disarm(flow.client_conn.id)  # the CONNECT's headers are complete

    def http_connected(self, flow: http.HTTPFlow) -> None:
        self._arm(flow.client_conn.id, PHASE_TLS, self.limits.tls_handshake_timeout)

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        conn = self.conns.get(data.context.client.id)
        if conn is not None and conn.in_flight == 0 and not conn.streaming:
            self._arm(data.context.client.id, PHASE_TLS, self.limits.tls_handshake_timeout)

    def tls_established_client(self, data: tls.TlsData) -> None:
        conn = self.conns.get(data.context.client.id)
        if conn is not None and conn.in_flight == 0 and not conn.streaming:
            self._arm(data.context.client.id, PHASE_HEADERS, self.limits.header_timeout)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        conn = self.conns.get(flow.client_conn.id)
        if conn is None:
            return
        fs = ensure_flow_state(flow)
        if fs.in_flight:
            return
        fs.in_flight = True
        conn.in_flight += 1
        self._cancel(conn)

    def response(self, flow: http.HTTPFlow) -> None:
        self._request_done(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._request_done(flow)

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        self._streaming(flow.client_conn.id)

    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        self._streaming(flow.client_conn.id)

    def _request_done(self, flow: http.HTTPFlow) -> None:
        conn = self.conns.get(flow.client_conn.id)
        fs = flow_state(flow)
        if conn is None or fs is None or not fs.in_flight:
            return
        fs.in_flight = False
        conn.in_flight -= 1
        if conn.in_flight == 0 and not conn.streaming and flow.websocket is None:
            self._arm(flow.client_conn.id, PHASE_KEEPALIVE, self.limits.keepalive_timeout)

    def _streaming(self, client_id: str) -> None:
        conn = self.conns.get(client_id)
        if conn is not None:
            conn.streaming = True
            self._cancel(conn)

    # ------------------------------------------------------------------ deadlines
    # A deadline is a timestamp on the connection, and each connection has at most one asyncio timer. A
    # kept-alive connection moves its deadline twice per request (cleared at the request headers, set at
    # the response); creating and cancelling a timer each time cost two heap operations and a TimerHandle
    # per request, and left cancelled handles in the loop's heap. Now moving a deadline later only writes
    # the timestamp; the timer, when it fires, re-arms itself for the deadline that holds then (or does
    # nothing if none does). A deadline moved *earlier* replaces the timer, so no deadline ever fires late.
    def _identified(self, client_id: str) -> bool:
        """Bound to a sandbox and not refused. A refused transparent connection (revoked sandbox, over
        the sandbox's limit: transparent_decide.identify) names the sandbox in its records but keeps
        counting against its source, or a revoked sandbox could hold any number of them open."""
        state = self.rt.conns.get(client_id)
        return state is not None and state.sandbox_id is not None and state.refusal is None

    def _arm(self, client_id: str, phase: str, seconds: float) -> None:
        conn = self.conns.get(client_id)
        if conn is None:
            return
        loop = asyncio.get_running_loop()
        conn.deadline = loop.time() + seconds
        conn.phase, conn.seconds = phase, seconds
        if conn.timer is None or conn.timer_at > conn.deadline:
            if conn.timer is not None:
                conn.timer.cancel()
            conn.timer = loop.call_at(conn.deadline, self._fire, client_id)
            conn.timer_at = conn.deadline

    def _disarm(self, client_id: str) -> None:
        conn = self.conns.get(client_id)
        if conn is not None:
            self._cancel(conn)

    @staticmethod
    def _cancel(conn: _Conn) -> None:
        """No deadline runs; the timer, if any, finds none when it fires."""
        conn.deadline = None

    @staticmethod
    def _drop_timer(conn: _Conn) -> None:
        conn.deadline = None
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    def _fire(self, client_id: str) -> None:
        conn = self.conns.get(client_id)
        if conn is None:
            return
        conn.timer = None
        if conn.deadline is None:
            return
        loop = asyncio.get_running_loop()
        if conn.deadline > loop.time() + _EARLY:  # moved later since the timer was set: wait for it
            conn.timer = loop.call_at(conn.deadline, self._fire, client_id)
            conn.timer_at = conn.deadline
            return
        conn.deadline = None
        self._expire(client_id, conn.phase, conn.seconds)

    def _expire(self, client_id: str, phase: str, seconds: float) -> None:
        conn = self.conns[client_id]
        if conn.refused is not None:  # already audited as connection_limit
            self._abort(client_id)
            return
        if phase == PHASE_KEEPALIVE and self.write_backlog(client_id) > 0:
            # the response hook runs before a buffered body is written: a slow reader is not idle
            self._arm(client_id, PHASE_KEEPALIVE, seconds)
            return
        pending = self.pending_bytes(client_id) if phase == PHASE_KEEPALIVE else None
        logger.debug("deadline %s of %s passed (buffered request bytes: %s)", phase, client_id, pending)
        if phase == PHASE_KEEPALIVE and pending == 0:
            logger.debug("closing idle keep-alive connection %s after %.0fs", client_id, seconds)
            self._abort(client_id)
            return
        reason, setting = ((Reason.TLS_HANDSHAKE_TIMEOUT, "tls_handshake_timeout") if phase == PHASE_TLS
                           else (Reason.HEADER_TIMEOUT,
                                 "keepalive_timeout" if phase == PHASE_KEEPALIVE else "header_timeout"))
        state = self.rt.conns.get(client_id)
        what = "TLS handshake" if phase == PHASE_TLS else "request headers"
        self.audit.record(reason, conn.source,
                          f"the client did not complete its {what} within {seconds:g}s "
                          f"(limits.{setting}); connection closed",
                          sandbox_id=state.sandbox_id if state is not None else None,
                          extra={"egressgate.limit": setting})
        logger.info("closing connection %s from %s: %s after %gs", client_id, conn.source, reason, seconds)
        self._abort(client_id)

    def _header_overflow(self, client_id: str, source: str, size: int) -> str:
        """Called by http_limits.py, which answers 431 and closes; returns the id the deny body shows."""
        request_id = new_request_id()
        state = self.rt.conns.get(client_id)
        limit = self.limits.max_header_bytes
        self.audit.record(Reason.HEADER_TOO_LARGE, source,
                          f"request head larger than {limit} bytes (limits.max_header_bytes; {size} buffered); "
                          f"refused with 431 and closed",
                          sandbox_id=state.sandbox_id if state is not None else None, request_id=request_id,
                          extra={"egressgate.limit": "max_header_bytes"})
        return request_id

    def _abort(self, client_id: str) -> None:
        if self.rt.abort_connection is not None:
            self.rt.abort_connection(client_id)

