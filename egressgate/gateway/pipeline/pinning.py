"""Resolve once, check every address, dial exactly the checked one, verify the peer.

mitmproxy resolves a name again after `server_connect`, which would let a rebinding resolver answer
differently for the check and for the dial. So pinning is one stage in three steps, all here:

- stage: the decision addons resolve (destination.py `resolve_target`), classify every address with policy/addr.py
  and put the `PinnedTarget` on the flow (`FlowState.pinned`); a forbidden address is the decision;
- commit (`Pinning.http_connect` / `requestheaders`, right after record.py): only an allow whose audit
  record is durable becomes dialable — the address mitmproxy will ask for (`FlowState.dial_key`) is
  approved on the connection, a CONNECT binds its tunnel to the target;
- enforce: `server_connect` rewrites the server address to the pinned IP (mitmproxy dials it without
  resolving) and the SNI to the name, and refuses any server connection nobody decided on;
  `server_connected` checks the socket's real peer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from mitmproxy import http
from mitmproxy.proxy import server_hooks

from egressgate.gateway.shared.context import Runtime, flow_state
from egressgate.gateway.shared.destination import address_verdict, bind_tunnel
from egressgate.policy.facts import IPAddress

logger = logging.getLogger(__name__)


def _same_ip(a: IPAddress, b: IPAddress) -> bool:
    if a == b:
        return True
    # A v4 destination on a dual-stack socket may be reported as ::ffff:a.b.c.d.
    for x, y in ((a, b), (b, a)):
        if isinstance(x, ipaddress.IPv6Address) and x.ipv4_mapped is not None and x.ipv4_mapped == y:
            return True
    return False


class Pinning:
    """Addon: the only place a destination becomes dialable and a server address is set; refuses
    undecided destinations. Runs after record.py, so `fs.audited` and an allowed `fs.decision` together
    mean: allowed, and the record saying so is durable."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Commit an allowed CONNECT: the connection becomes a tunnel to the pinned target."""
        fs = flow_state(flow)
        if fs is None or not fs.audited or fs.decision is None or not fs.decision.allowed or fs.pinned is None:
            return
        assert fs.host is not None and fs.port is not None
        conn = self.rt.conn(flow.client_conn.id)
        conn.intercept = fs.intercept is not False
        conn.passthrough = fs.decision.passthrough  # spliced after passthrough.py's SNI check
        if not conn.intercept:
            conn.allow_tcp(fs.decision.rule_id, fs.request_id)  # a raw-TCP or passthrough rule: relay, no MITM
        fs.dial_key = (flow.request.host, flow.request.port)
        bind_tunnel(conn, fs.host, fs.port, fs.target_as_sent, fs.pinned, fs.dial_key)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Commit an allowed request's destination. Inside a tunnel there is nothing to commit (the
        CONNECT did); a transparent connection's first request staged its own key (transparent.py)."""
        fs = flow_state(flow)
        if (fs is None or not fs.audited or fs.decision is None or not fs.decision.allowed or fs.pinned is None
                or flow.response is not None):
            return
        conn = self.rt.conn(flow.client_conn.id)
        if fs.dial_key is None:
            if conn.tunnel_host is not None:
                return
            req = flow.request
            if fs.scheme == "http":
                # Plain HTTP: dial by the checked IP (data.host: the Host header stays as sent), so the next
                # request to the same pinned address reuses the upstream connection instead of opening a
                # new one per request. Not for absolute-form https: a TLS session authenticated for one name
                # must not carry another name's requests.
                req.data.host = str(fs.pinned.address)
            fs.dial_key = (req.host, req.port)
        conn.approved[fs.dial_key] = fs.pinned

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        conn = self.rt.conns.get(data.client.id)
        address = data.server.address
        target = conn.approved.get((address[0], address[1])) if conn is not None and address else None
        if conn is None or target is None or conn.closed:
            data.server.error = "egressgate: no allow decision for this destination"
            logger.warning("refused undecided server connection to %s", address)
            return
        policy = self.rt.policies.get(conn.policy_name)
        if policy is None:
            data.server.error = "egressgate: no policy for this sandbox"
            return
        denied = address_verdict(target.address, policy.allow_private)
        if denied is not None or self.rt.is_self(target.address, target.port):
            data.server.error = f"egressgate: pinned address {target.address} refused"
            return
        data.server.address = (str(target.address), target.port)
        data.server.sni = target.sni if target.sni is not None else str(target.address)
        conn.approved[(str(target.address), target.port)] = target
        self._arm_connect_timeout(data)

    def _arm_connect_timeout(self, data: server_hooks.ServerConnectionHookData) -> None:
        """mitmproxy has no connect timeout (an unanswered SYN waits for the kernel's ~2 minutes):
        cancel the connecting task after `upstream.connect_timeout`; mitmproxy then reports the error."""
        timeout = self.rt.config.upstream.connect_timeout
        client_id, server = data.client.id, data.server

        def expire() -> None:
            self._timers.pop(server.id, None)
            if server.timestamp_tcp_setup is not None or server.error:
                return
            task = self.rt.server_task(client_id, server) if self.rt.server_task is not None else None
            if task is not None and not task.done():
                logger.info("connect to %s timed out after %.1fs", server.address, timeout)
                server.error = f"egressgate: connect timeout after {timeout:g}s"
                task.cancel()

        self._timers[server.id] = asyncio.get_running_loop().call_later(timeout, expire)

    def _disarm(self, data: server_hooks.ServerConnectionHookData) -> None:
        timer = self._timers.pop(data.server.id, None)
        if timer is not None:
            timer.cancel()

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._disarm(data)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._disarm(data)
        conn = self.rt.conns.get(data.client.id)
        peer = data.server.peername
        target = None
        if conn is not None and data.server.address:
            target = conn.approved.get((data.server.address[0], data.server.address[1]))
        ok = False
        if target is not None and peer:
            try:
                ok = _same_ip(ipaddress.ip_address(str(peer[0]).split("%", 1)[0]), target.address)
            except ValueError:
                ok = False
        if not ok:
            logger.error("peer %s is not the pinned address of %s; aborting", peer, data.server.address)
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(data.client.id)
