"""`tls: passthrough` tunnels: the ClientHello must name the CONNECT host, then the bytes are spliced unread.

A passthrough route is for clients that pin certificates (the gateway CA would break them) and for bulk
downloads. The CONNECT was decided, resolved and pinned like any other (decision.py, pinning.py: the
upstream connection goes to the checked address only), and its allow record is durable before this layer
runs. What is left to check is the one name the gateway can still see, the SNI in the client's
ClientHello, because a tunnel to an allowed host must not carry a TLS session to another one (domain
fronting through a shared front end). client_hello.check_hello refuses, before a byte goes upstream:

* bytes that are not TLS handshake records, or a first handshake message that is not a ClientHello;
* a ClientHello larger than `limits.max_client_hello_bytes` (scanned incrementally with tls_limits'
  HelloScan, so a client splitting it into tiny records costs linear time and bounded memory);
* a ClientHello that does not name the CONNECT host exactly once in clear: no server_name (unless the
  CONNECT host is an IP literal, where RFC 6066 forbids one), several server_name extensions or entries,
  a name that is not the CONNECT host after canonicalization (policy/canon.py), or an Encrypted
  ClientHello (its outer SNI is not the name the session is for).

Whatever the client sends behind its ClientHello is held (up to the same bound) until the server's first
handshake message arrives: a TLS 1.3 HelloRetryRequest makes the client send a second ClientHello in
clear, which servers act on again, so it gets the same check (and bytes pipelined before the retry are
judged as that second ClientHello, never relayed unseen). A client that half-closes meanwhile still
has them sent up after the server's hello, then its FIN.

A refusal is a fatal TLS `access_denied` alert (`illegal_parameter` for the size bound) and a close,
recorded as the tunnel's outcome record with decision `deny` and the reason. An accepted tunnel relays
client and server bytes unchanged, counting every byte in both directions against the sandbox's ledger
(a `Meter` over the sandbox's leased pool, ledger.py); a client chunk the lease cannot cover pauses the
tunnel (a blocking `BudgetTopUpHook` here, paused reading in splice.py) until the lease is topped up, and
one the budget cannot hold is dropped and the connection aborted (budgets.py's rule for raw TCP). The
relay runs here (no per-chunk addon hook) until splice.py takes both sockets off mitmproxy's event path,
with the same counting. The meter is closed (its unused lease given back) with the outcome record.
Before this layer runs, layers/next_layer.py has written the tunnel into the sandbox's request history (history.py);
a history that could not be written arrives here as `refusal`, applied at the client's first bytes.
Revocation aborts the connection like any other (revocation.py). When both sides are closed, one outcome
record (bytes, duration, `egressgate.tls` = `passthrough`, the SNI) follows the CONNECT's allow record,
under its request id. Nothing inside the TLS is checked: no Host, method, path, credential, or response.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mitmproxy import tcp
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.tcp import TcpStartHook

from egressgate.audit.build import build
from egressgate.audit.event import EventKind
from egressgate.gateway.layers.client_hello import ALERT_ACCESS_DENIED, check_hello, server_hello_kind
from egressgate.gateway.layers.tls_limits import ALERT_GRACE, ALERT_ILLEGAL_PARAMETER, HelloScan
from egressgate.gateway.shared.context import ConnState, Runtime, new_request_id
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.emit import conn_attributes, write_behind
from egressgate.gateway.shared.ledger import BudgetTopUpHook, Meter, TopUp
from egressgate.gateway.tunnels.splice import Splice, Tally
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)

TLS_ATTRIBUTE = {"egressgate.tls": "passthrough"}
# Loop iterations the take-over may wait in a row for mitmproxy to hand the layer what it read (splice.py,
# `_parked`); after that each event the layer relays asks again. A tunnel that never lets go stays on
# the event path (slower, same counting).
TAKE_OVER_TRIES = 100


class PassthroughLayer(layer.Layer):
    """The whole tunnel after the CONNECT: ClientHello check, then a counting splice (see module doc)."""

    def __init__(self, context, rt: Runtime, conn: ConnState, refusal: Decision | None = None) -> None:
        """`refusal`: the tunnel is refused at the client's first bytes (history.py could not record it)."""
        super().__init__(context)
        self.rt, self.conn = rt, conn
        self.buf = bytearray()
        self.scan = HelloScan()
        self.flow = tcp.TCPFlow(context.client, context.server, live=True)
        self.started_ns = time.time_ns()
        self.sandbox_id = conn.sandbox_id or ""
        self.sni: str | None = None
        self.hellos = 0  # ClientHellos checked (2 after a HelloRetryRequest)
        self.held = bytearray()  # client bytes behind a checked ClientHello, until the server answers
        self.server_scan, self.server_buf = HelloScan(), bytearray()
        self.tally = Tally()
        self.meter: Meter | None = None  # opened at the first byte up, closed with the outcome record
        self.splice: Splice | None = None
        self.take_over_tries = 0
        self.take_over_due = False  # a `_take_over` is scheduled
        self.take_over_off = False  # these sockets cannot be spliced (TLS transport, EOF seen): never again
        self.client_eof = False  # the client half-closed before the server's hello (passed on after it)
        self.refusal: Decision | None = None
        self.preset = refusal
        self.error: str | None = None
        self.recorded = False
        self._handle_event = self._start

    # ------------------------------------------------------------------ phases
    def _start(self, event: events.Event) -> layer.CommandGenerator[None]:
        if not isinstance(event, events.Start):
            return
        self._handle_event = self._hello
        if self.context.server.timestamp_start is None:  # transparent: nothing was dialed yet
            err = yield commands.OpenConnection(self.context.server)
            if err:
                self.error = f"upstream connection failed: {err}"
                self._handle_event = self._done
                yield commands.CloseConnection(self.context.client)
                self._record()

    def _hello(self, event: events.Event) -> layer.CommandGenerator[None]:
        """Waiting for a ClientHello: the first one, or the second one after a HelloRetryRequest."""
        if isinstance(event, events.ConnectionClosed):
            self.error = "closed before the ClientHello was complete"
            self.refusal = self.refusal or self.preset  # a refused tunnel stays refused in its outcome
            yield from self._close_all()
            return
        if not isinstance(event, events.DataReceived):
            return
        if self.preset is not None:
            yield from self._refuse(self.preset)
            return
        if event.connection is not self.context.client:
            if not self.hellos:  # TLS: the server never speaks first
                yield from self._refuse(gateway_deny(Reason.PROTOCOL_NOT_ALLOWED, "The upstream spoke before "
                                                     "the client's ClientHello; this is not TLS.",
                                                     detail="server_first"))
                return
            yield from self._to_client(event.data)
            return
        self.buf += event.data
        yield from self._scan_hello()

    def _scan_hello(self) -> layer.CommandGenerator[None]:
        if self.hellos:
            # after a HelloRetryRequest: the client's change_cipher_spec (middlebox compatibility) and any
            # early data still in flight come before the second ClientHello; they pass, in order
            while len(self.buf) >= 5 and self.buf[0] in (0x14, 0x17):
                size = 5 + int.from_bytes(self.buf[3:5], "big")
                if len(self.buf) < size:
                    return
                record, self.buf = bytes(self.buf[:size]), self.buf[size:]
                yield from self._to_server(record)
            if len(self.buf) < 5:
                return
        scan = self.scan
        scan.feed(self.buf)
        limit = self.rt.config.limits.max_client_hello_bytes
        if (scan.announced is not None and scan.announced > limit) or scan.offset > limit:
            yield from self._refuse(gateway_deny(
                Reason.CLIENT_HELLO_TOO_LARGE,
                f"TLS ClientHello larger than {limit} bytes (limits.max_client_hello_bytes).",
                detail="max_client_hello_bytes"), ALERT_ILLEGAL_PARAMETER)
            return
        if scan.invalid:
            yield from self._refuse(gateway_deny(
                Reason.PROTOCOL_NOT_ALLOWED,
                f"A passthrough route to {self.conn.tunnel_host} carries TLS only; send a TLS ClientHello.",
                detail="not_tls"))
            return
        if not scan.complete:
            return
        assert scan.announced is not None and self.conn.tunnel_host is not None
        if len(scan.hello) != scan.announced:  # another handshake message packed behind the ClientHello
            yield from self._refuse(gateway_deny(Reason.INVALID_REQUEST, "Nothing may follow the ClientHello "
                                                 "in its last record.", detail="trailing_handshake_data"))
            return
        sni, refusal = check_hello(bytes(scan.hello), self.conn.tunnel_host)
        self.sni = self.sni if self.hellos else sni
        if refusal is None and self.conn.closed:
            refusal = gateway_deny(Reason.SANDBOX_REVOKED)
        if refusal is not None:
            self.sni = sni
            yield from self._refuse(refusal)
            return
        if not self.hellos:
            # One hook per tunnel, not per chunk: layers/next_layer.py's tcp_start refuses a relay no decision
            # allowed, connguard.py stops the handshake deadline (a relay has only the idle timeout).
            yield TcpStartHook(self.flow)
            if self.flow.error is not None or self.conn.closed:
                yield from self._refuse(gateway_deny(Reason.INTERNAL_ERROR if not self.conn.closed
                                                     else Reason.SANDBOX_REVOKED))
                return
        self.hellos += 1
        # the ClientHello goes up; whatever the client sent behind it is held until the server has
        # answered: were that answer a HelloRetryRequest, a second ClientHello must be checked first
        hello, self.held, self.buf = bytes(self.buf[:scan.offset]), self.buf[scan.offset:], bytearray()
        self.scan, self.server_scan, self.server_buf = HelloScan(), HelloScan(), bytearray()
        self._handle_event = self._await_server
        yield from self._to_server(hello)
        yield from self._check_held()

    def _await_server(self, event: events.Event) -> layer.CommandGenerator[None]:
        """A checked ClientHello went up; the server's first handshake message decides what follows."""
        if isinstance(event, events.ConnectionClosed):
            if event.connection is self.context.client and self.context.client.state & ConnectionState.CAN_WRITE \
                    and self.context.server.state & ConnectionState.CAN_READ:
                # a half-close: what the client sent before it still goes up, after the server's hello
                self.client_eof = True
                return
            self.error = "closed before the server's hello"
            yield from self._close_all()
            return
        if not isinstance(event, events.DataReceived):
            return
        if event.connection is self.context.client:
            self.held += event.data
            yield from self._check_held()
            return
        yield from self._to_client(event.data)
        self.server_buf += event.data
        kind = server_hello_kind(self.server_scan, self.server_buf)
        if kind is None:
            if len(self.server_buf) > self.rt.config.limits.max_client_hello_bytes:
                yield from self._refuse(gateway_deny(Reason.PROTOCOL_NOT_ALLOWED, "The upstream's first TLS "
                                                     "message could not be read.", detail="server_hello_unreadable"))
            return
        self.server_scan, self.server_buf = HelloScan(), bytearray()
        held, self.held = bytes(self.held), bytearray()
        if kind == "hrr":
            if self.hellos >= 2:  # RFC 8446 4.1.4: a client aborts on a second HelloRetryRequest
                yield from self._refuse(gateway_deny(Reason.PROTOCOL_NOT_ALLOWED, "A second HelloRetryRequest "
                                                     "is not TLS 1.3.", detail="second_hello_retry"))
                return
            self._handle_event = self._hello
            self.buf = bytearray(held)
            yield from self._scan_hello()
            if self.client_eof and self._handle_event == self._hello:  # no second ClientHello will follow
                self.error = "closed before the ClientHello was complete"
                yield from self._close_all()
            return
        self._handle_event = self._relay
        if held:
            yield from self._to_server(held)
        if self.client_eof:  # after everything the client sent; the tunnel stays on the event path
            self.take_over_off = True
            yield commands.CloseTcpConnection(self.context.server, half_close=True)
            return
        # the rest of the tunnel bypasses mitmproxy's event path (splice.py), as soon as mitmproxy has
        # handed the layer everything it read
        self._schedule_take_over()

    def _check_held(self) -> layer.CommandGenerator[None]:
        if len(self.held) > self.rt.config.limits.max_client_hello_bytes:
            yield from self._refuse(gateway_deny(
                Reason.PROTOCOL_NOT_ALLOWED,
                "Too much data before the server's TLS hello (it is held until the server answers).",
                detail="early_data_too_large"))

    def _schedule_take_over(self) -> None:
        if not (self.take_over_due or self.take_over_off or self.splice is not None):
            self.take_over_due = True
            asyncio.get_running_loop().call_soon(self._take_over)

    def _take_over(self) -> None:
        """Hand the sockets to the splice once nothing of theirs is on mitmproxy's event path: not while a
        layer of this connection is paused (this one waits for a lease top-up, BudgetTopUpHook: mitmproxy
        queues the events that arrive meanwhile in the layer and replays them afterwards, which would write
        them after bytes the splice relayed first), nor while one of mitmproxy's reader tasks holds a chunk
        or an EOF it read and has not handed on yet (splice.py, `_parked`). Then the next loop iteration
        tries again, and after TAKE_OVER_TRIES in a row the next event this layer relays does."""
        self.take_over_due = False
        if self.tally.cut or self.conn.closed or self._handle_event != self._relay or self.splice is not None:
            return
        paused = any(each._paused is not None or each._paused_event_queue for each in self.context.layers)
        splice = None if paused else Splice(self.rt, self.sandbox_id, self._meter(), self.tally)
        taken = None if splice is None else splice.take_over(self.context.client, self.context.server)
        if taken:
            self.splice = splice
        elif taken is False:
            self.take_over_off = True
            logger.debug("passthrough tunnel of %s stays on the event path", self.context.client.id)
        elif self.take_over_tries < TAKE_OVER_TRIES:
            self.take_over_tries += 1
            self._schedule_take_over()

    def _relay(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived):
            if self.splice is not None:  # cannot happen (splice.py, `_parked`): say so, keep the order
                logger.error("passthrough tunnel of %s: mitmproxy delivered %d bytes after the take-over",
                             self.context.client.id, len(event.data))
            if event.connection is self.context.client:
                yield from self._to_server(event.data)
            else:
                yield from self._to_client(event.data)
            self._schedule_take_over()  # mitmproxy handed this chunk on: its reader may be parked now
        elif isinstance(event, events.ConnectionClosed):
            client, server = self.context.client, self.context.server
            if (client.state & ConnectionState.CAN_READ) or (server.state & ConnectionState.CAN_READ):
                other = server if event.connection is client else client
                yield commands.CloseTcpConnection(other, half_close=True)
                return
            yield from self._close_all()

    def _done(self, _event: events.Event) -> layer.CommandGenerator[None]:
        yield from ()

    # ------------------------------------------------------------------ helpers
    def _meter(self) -> Meter:
        if self.meter is None:
            policy = self.rt.policies.get(self.conn.policy_name)
            self.meter = self.rt.ledger.open(self.sandbox_id, policy.outbound_bytes_max if policy is not None else 0)
        return self.meter

    def _to_server(self, data: bytes) -> layer.CommandGenerator[None]:
        if self.tally.cut:
            return
        meter = self._meter()
        paid = meter.take(len(data))
        if not paid:
            top = TopUp(self.flow, meter, len(data))
            yield BudgetTopUpHook(top)  # this layer pauses (its events queue) while the lease tops up
            if self.tally.cut or self._handle_event == self._done:
                return
            paid = meter.take(len(data))  # from the credit the hook covered, unless the store refused
        if not paid:
            # the chunk that would cross is never relayed; RST both sides (a cut stream must not look
            # complete to the upstream)
            self.tally.cut = True
            self.tally.cut_reason = meter.failed  # the store failed during the top-up, not the budget
            logger.info("sandbox %s crossed outbound_bytes_max in a passthrough tunnel; cutting", self.sandbox_id)
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(self.context.client.id)
            return
        self.tally.out += len(data)
        yield commands.SendData(self.context.server, data)

    def _to_client(self, data: bytes) -> layer.CommandGenerator[None]:
        self.tally.in_ += len(data)
        self.rt.ledger.add_in(self.sandbox_id, len(data))
        yield commands.SendData(self.context.client, data)

    def _refuse(self, decision: Decision, alert: bytes = ALERT_ACCESS_DENIED) -> layer.CommandGenerator[None]:
        self.refusal = decision
        self.buf, self.held = bytearray(), bytearray()
        logger.info("passthrough tunnel %s:%s refused: %s (%s)", self.conn.tunnel_host, self.conn.tunnel_port,
                    decision.reason, decision.detail)
        yield commands.SendData(self.context.client, alert)
        if self.rt.abort_connection_later is not None:
            self.rt.abort_connection_later(self.context.client.id, ALERT_GRACE)
        yield from self._close_all()

    def _close_all(self) -> layer.CommandGenerator[None]:
        self._handle_event = self._done
        for connection in (self.context.server, self.context.client):
            if connection.state is not ConnectionState.CLOSED:
                yield commands.CloseConnection(connection)
        self.flow.live = False
        self._record()

    def _record(self) -> None:
        """The tunnel's one outcome record, under the CONNECT's request id."""
        if self.recorded:
            return
        self.recorded = True
        if self.meter is not None:
            self.meter.close()
        conn = self.conn
        refusal = self.refusal
        tally = self.tally
        if refusal is None and tally.cut:
            refusal = gateway_deny(Reason.STATE_UNAVAILABLE if tally.cut_reason else Reason.BUDGET_EXCEEDED,
                                   detail="outbound_bytes_max")
        elif refusal is None and conn.closed:
            refusal = gateway_deny(Reason.SANDBOX_REVOKED)
        extra: dict = {**TLS_ATTRIBUTE, **conn_attributes(conn)}
        if self.sni is not None:
            extra["egressgate.tls.sni"] = self.sni
        if refusal is not None and refusal.detail:
            extra["egressgate.detail"] = refusal.detail
        if tally.cut and not tally.cut_reason:
            extra["egressgate.budget_cut"] = True
        if self.error:
            extra["egressgate.error"] = self.error
        policy = self.rt.policies.get(conn.policy_name)
        if conn.tcp_request_id is None:
            logger.error("passthrough outcome for client %s has no decision request id", conn.client_id)
        write_behind(self.rt, build(
            EventKind.OUTCOME, request_id=conn.tcp_request_id or new_request_id(),
            sandbox_id=conn.sandbox_id, decision="deny" if refusal is not None else "allow",
            reason=str(refusal.reason if refusal is not None else Reason.RULE_MATCHED),
            rule_id=conn.tcp_allowed_rule, policy_name=conn.policy_name,
            policy_hash=policy.hash if policy is not None else None, scheme="https", host=conn.tunnel_host,
            port=conn.tunnel_port, bytes_out=tally.out, bytes_in=tally.in_,
            duration_ms=(time.time_ns() - self.started_ns) / 1e6,
            message=refusal.message if refusal is not None else None, extra=extra,
        ))

