"""Passthrough on the transparent listener: the name of the route is the SNI, so read it before choosing.

On the explicit proxy a passthrough tunnel is decided at its CONNECT; a transparent connection names its
destination only in its ClientHello. When the sandbox's policy has passthrough rules, transparent.py
starts a TLS connection on `SniPeekLayer`, which reads the ClientHello (bounded and linear, tls_limits'
HelloScan), asks the addons whether its one clear SNI is a passthrough route (`passthrough_name` hook,
answered by transparent.py: decided, resolved, pinned, recorded, committed), and then gives every byte
so far to the chosen layer: the splice (passthrough.PassthroughLayer, which checks the same ClientHello
again against the committed name) or the usual interception stack, which decides and records the name
itself. A ClientHello with no single clear SNI (none, several, ECH), too large or not TLS goes to
interception, whose own checks refuse or intercept it: it is never spliced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.commands import StartHook

from egressgate.gateway.layers.client_hello import read_sni
from egressgate.gateway.layers.tls_limits import HelloScan
from egressgate.gateway.shared.context import ConnState, Runtime
from egressgate.gateway.tunnels.passthrough import PassthroughLayer


@dataclass
class SniName:
    """A transparent connection's complete ClientHello names `sni` (exactly one host_name, in clear).
    The addon answering PassthroughNameHook sets `splice` once the name is decided as a passthrough
    route, recorded and committed to the connection (transparent.py)."""

    context: Any  # mitmproxy's Context: FailClosed aborts its client if the addon crashes
    sni: str
    splice: bool = False


@dataclass
class PassthroughNameHook(StartHook):
    """Transparent listener, policy with passthrough rules: may this connection be spliced?"""

    data: SniName


class SniPeekLayer(layer.Layer):
    """The first layer of a transparent TLS connection under a policy with passthrough rules (module doc);
    `intercept()` builds the interception stack it falls back to."""

    def __init__(self, context, rt: Runtime, conn: ConnState, intercept: Callable[[], layer.Layer]) -> None:
        super().__init__(context)
        self.rt, self.conn, self.intercept = rt, conn, intercept
        self.buf = bytearray()
        self.scan = HelloScan()
        self.child: layer.Layer | None = None

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.child is not None:
            yield from self.child.handle_event(event)
            return
        if isinstance(event, events.ConnectionClosed) and event.connection is self.context.client:
            yield commands.CloseConnection(self.context.client)
            return
        if not isinstance(event, events.DataReceived) or event.connection is not self.context.client:
            return  # Start (replayed to the child below); nothing else can come before a server exists
        self.buf += event.data
        scan = self.scan
        scan.feed(self.buf)
        limit = self.rt.config.limits.max_client_hello_bytes
        over = (scan.announced is not None and scan.announced > limit) or scan.offset > limit
        if not (scan.complete or scan.invalid or over):
            return
        sni = None
        if scan.complete and not over and len(scan.hello) == scan.announced:
            sni, problem = read_sni(bytes(scan.hello))
            sni = sni if problem is None else None
        self.scan = HelloScan()
        asked = SniName(self.context, sni) if sni is not None else None
        if asked is not None:
            yield PassthroughNameHook(asked)
        spliced = asked is not None and asked.splice and self.conn.passthrough
        self.child = PassthroughLayer(self.context, self.rt, self.conn) if spliced else self.intercept()
        data, self.buf = bytes(self.buf), bytearray()
        yield from self.child.handle_event(events.Start())
        yield from self.child.handle_event(events.DataReceived(self.context.client, data))
