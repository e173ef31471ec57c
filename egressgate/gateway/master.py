"""mitmproxy embedded as a library, with only the addons egressgate needs.

No default addon set: no ignore/allow-hosts passthrough, no raw-TCP or DNS relays, no replay, no
scripts, no onboarding app. The addon order below is part of the security design (each hook runs the
addons in this order; a deny set by an earlier addon is final). docs/architecture.md is the one
description of it: which addon implements which hook, why it sits where it does, and the path of a
plain HTTP request, an intercepted CONNECT, a WebSocket, a raw-TCP relay, a DNS query and a
transparent connection. Change the order here and there together.

`mitmproxy.ctx` is process-global: one GatewayMaster per process.
"""

from __future__ import annotations

import asyncio
import logging

from mitmproxy import master as mitm_master
from mitmproxy import options
from mitmproxy.addons import proxyserver, tlsconfig
from mitmproxy.proxy import layer, mode_specs
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.proxy.layers.http._http2 import Http2Server

from egressgate.gateway.failclosed import FailClosed
from egressgate.gateway.layers.next_layer import NextLayer
from egressgate.gateway.mcp.route import McpRoute
from egressgate.gateway.mitm import dispatch
from egressgate.gateway.pipeline.budgets import Budgets
from egressgate.gateway.pipeline.connguard import ConnGuard
from egressgate.gateway.pipeline.consistency import Consistency
from egressgate.gateway.pipeline.credential_response import ResponseScrub
from egressgate.gateway.pipeline.credentials import Credentials
from egressgate.gateway.pipeline.decision import DecisionAddon
from egressgate.gateway.pipeline.enforce import Enforce
from egressgate.gateway.pipeline.identity import Identity
from egressgate.gateway.pipeline.pinning import Pinning
from egressgate.gateway.pipeline.record import Record
from egressgate.gateway.pipeline.refused_tunnel import RefusedTunnel
from egressgate.gateway.pipeline.revocation import Revocation
from egressgate.gateway.pipeline.sanitize import Sanitize
from egressgate.gateway.pipeline.trailers import Trailers
from egressgate.gateway.pipeline.transparent import Transparent
from egressgate.gateway.shared.context import Runtime

logger = logging.getLogger(__name__)

STOP_GRACE = 2.0  # seconds stop() waits for aborted connections to finish (their records to be written)


class _Running:
    """Tiny addon: tells start() when the listeners are up."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def running(self) -> None:
        self.event.set()


def _abort(client_id: str, writers: list) -> None:
    for writer in writers:
        transport = getattr(writer, "transport", None)
        try:
            if transport is not None:
                transport.abort()
            else:
                writer.close()
        except Exception:
            logger.debug("abort of %s failed", client_id, exc_info=True)


def _spec(kind: str, address: tuple[str, int]) -> str:
    host, port = address
    return f"{kind}@[{host}]:{port}" if ":" in host else f"{kind}@{host}:{port}"


class GatewayMaster:
    def __init__(self, runtime: Runtime, listen: tuple[str, int],
                 transparent: tuple[str, int] | None = None) -> None:
        self.rt = runtime
        self.listen = listen
        self.transparent = transparent
        self.master: mitm_master.Master | None = None
        self.proxyserver: proxyserver.Proxyserver | None = None
        self._task: asyncio.Task | None = None

    def abort_connection(self, client_id: str) -> bool:
        """Abort a client connection and every upstream connection it owns, right now (RST, no
        graceful close: a cut body must not look complete to the upstream)."""
        writers = self._writers(client_id)
        if writers is None:
            return False
        _abort(client_id, writers)
        return True

    def abort_connection_later(self, client_id: str, delay: float) -> bool:
        """`abort_connection` in `delay` seconds, on the sockets the connection has *now*: by then
        mitmproxy may have forgotten a connection whose socket it failed to close (a reader task
        cancelled while it waited for mitmproxy's event lock ends without closing it). Aborting a
        socket that did close meanwhile does nothing."""
        writers = self._writers(client_id)
        if writers is None:
            return False
        asyncio.get_running_loop().call_later(delay, _abort, client_id, writers)
        return True

    def _writers(self, client_id: str) -> list | None:
        ps = self.proxyserver
        handler = ps.connections.get(client_id) if ps is not None else None
        if handler is None:
            return None
        ios = sorted(handler.transports.items(), key=lambda item: item[0] is handler.client)
        return [io.writer for _conn, io in ios if io.writer is not None]  # servers first, then the client

    def pending_bytes(self, client_id: str) -> int | None:
        """Bytes of an unfinished request the client has sent on this connection (HTTP/1 receive buffers
        of its layers), 0 when none, None when the connection or its layers are unknown (the caller then
        treats the connection as if it had sent some)."""
        ps = self.proxyserver
        handler = ps.connections.get(client_id) if ps is not None else None
        if handler is None:
            return None
        total = 0
        found = False
        stack: list[object] = [handler.layer]
        seen: set[int] = set()
        while stack:
            item = stack.pop()
            if item is None or id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, Http1Server):
                found = True
                total += len(item.buf)
                continue
            if isinstance(item, Http2Server):  # h2 frames partial HEADERS itself; an idle h2 conn is idle
                found = True
                continue
            if not isinstance(item, layer.Layer):
                continue
            stack.extend((getattr(item, "layer", None), getattr(item, "child_layer", None)))
            # some layers (modes.HttpProxy) keep their child only as the bound method they delegate to
            stack.append(getattr(vars(item).get("_handle_event"), "__self__", None))
            for attr in ("connections", "streams"):
                children = getattr(item, attr, None)
                if isinstance(children, dict):
                    stack.extend(children.values())
        return total if found else None

    def write_backlog(self, client_id: str) -> int:
        """Bytes queued for the client but not yet taken by its socket: a slow reader of a large
        response is busy, not idle."""
        ps = self.proxyserver
        handler = ps.connections.get(client_id) if ps is not None else None
        io = handler.transports.get(handler.client) if handler is not None else None
        transport = getattr(getattr(io, "writer", None), "transport", None)
        try:
            return int(transport.get_write_buffer_size()) if transport is not None else 0
        except Exception:
            return 0

    def server_task(self, client_id: str, server) -> asyncio.Task | None:
        """The task mitmproxy runs to open (then serve) `server` for this client, if any."""
        ps = self.proxyserver
        handler = ps.connections.get(client_id) if ps is not None else None
        io = handler.transports.get(server) if handler is not None else None
        return io.handler if io is not None else None

    async def _end_connections(self, grace: float = STOP_GRACE) -> None:
        """Abort every open client connection and wait (up to `grace`) for mitmproxy to finish them, while
        the addons and the audit sink still run. An outcome record is written when a layer or hook sees
        its connection end (a spliced passthrough tunnel, a raw-TCP relay, a streamed flow): a connection
        still open when the gateway stops would otherwise end after the sink closed, and its record would
        miss this run's trail (kept only in the retry spool for the next start)."""
        ps = self.proxyserver
        if ps is None or not ps.connections:
            return
        for client_id in list(ps.connections):
            self.abort_connection(client_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while ps.connections and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if ps.connections:
            logger.warning("%d connection(s) still open after %.1fs at stop", len(ps.connections), grace)

    async def start(self) -> dict[str, list[tuple[str, int]]]:
        """Start the listeners; returns their bound addresses by kind ("proxy", "transparent")."""
        opts = options.Options()
        master = mitm_master.Master(opts, with_termlog=False)
        dispatch.install(master)  # hooks reach only the addons that implement them (dispatch.py)
        self.proxyserver = proxyserver.Proxyserver()
        running = _Running()
        rt = self.rt
        record = Record(rt)
        ours = [ConnGuard(rt, self.pending_bytes, self.write_backlog),
                NextLayer(rt), tlsconfig.TlsConfig(), Identity(rt), Transparent(rt), Consistency(rt), Sanitize(),
                DecisionAddon(rt), Trailers(rt), Credentials(rt), Budgets(rt), ResponseScrub(rt),
                record, Pinning(rt), McpRoute(rt), Enforce(rt), RefusedTunnel(rt), Revocation(rt)]
        # every addon in the decision path fails closed (failclosed.py); TlsConfig too, since a failed
        # certificate step must not leave a connection half-configured. A refused flow is audited.
        guarded = (FailClosed(a, self.abort_connection, record.refused) for a in ours)
        master.addons.add(self.proxyserver, *guarded, running)
        _host, _port = self.listen
        modes = [_spec("regular", self.listen)]
        if self.transparent is not None:
            modes.append(_spec("transparent", self.transparent))
        opts.update(
            mode=modes,
            confdir=str(rt.config.ca_path()),
            ssl_verify_upstream_trusted_ca=rt.upstream_bundle,
            ssl_insecure=False,
            connection_strategy="eager",
            rawtcp=False,
            websocket=True,
            upstream_cert=True,
            ignore_hosts=[],
            allow_hosts=[],
            tcp_hosts=[],
            udp_hosts=[],
            stream_large_bodies=None,
            validate_inbound_headers=True,
            tcp_timeout=rt.config.limits.idle_timeout,
        )
        rt.abort_connection = self.abort_connection
        rt.abort_connection_later = self.abort_connection_later
        rt.server_task = self.server_task
        self.master = master
        self._task = asyncio.create_task(master.run(), name="mitmproxy-master")
        waiter = asyncio.create_task(running.event.wait())
        done, _ = await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            waiter.cancel()
            exc = self._task.exception()
            raise RuntimeError(f"proxy failed to start: {exc}")
        bound: dict[str, list[tuple[str, int]]] = {"proxy": [], "transparent": []}
        for server in self.proxyserver.servers:
            kind = "transparent" if isinstance(server.mode, mode_specs.TransparentMode) else "proxy"
            bound[kind].extend((str(a[0]), int(a[1])) for a in server.listen_addrs)
        missing = [what for what, want in (("proxy", self.listen), ("transparent", self.transparent))
                   if want is not None and not bound[what]]
        if missing:  # a runtime would DNAT sandboxes to a listener that is not there: refuse to start
            await self.stop()
            wanted = {"proxy": self.listen, "transparent": self.transparent}
            raise RuntimeError("; ".join(f"{what} listener failed to listen on {wanted[what]} (see log)"
                                         for what in missing))
        return bound

    async def stop(self) -> None:
        await self._end_connections()
        if self.master is not None:
            self.master.shutdown()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            self._task = None
