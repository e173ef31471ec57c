"""`tls: passthrough` tunnels: the ClientHello must name the CONNECT host, then the bytes are spliced unread.

A passthrough route is for clients that pin certificates (the gateway CA would break them) and for bulk
downloads. The CONNECT was decided, resolved and pinned like any other (decision.py, pinning.py: the
upstream connection goes to the checked address only), and its allow record is durable before this layer
runs. What is left to check is the one name the gateway can still see, the SNI in the client's
ClientHello, because a tunnel to an allowed host must not carry a TLS session to another one (domain
fronting through a shared front end). `check_hello` refuses, before a single byte goes upstream:

* bytes that are not TLS handshake records, or a first handshake message that is not a ClientHello;
* a ClientHello larger than `limits.max_client_hello_bytes` (scanned incrementally with tls_limits'
  HelloScan, so a client splitting it into tiny records costs linear time and bounded memory);
* a ClientHello that does not name the CONNECT host exactly once in clear: no server_name (unless the
  CONNECT host is an IP literal, where RFC 6066 forbids one), several server_name extensions or entries,
  a name that is not the CONNECT host after canonicalization (policy/canon.py), or an Encrypted
  ClientHello (its outer SNI is not the name the session is for).

A refusal is a fatal TLS `access_denied` alert (`illegal_parameter` for the size bound) and a close,
recorded as the tunnel's outcome record with decision `deny` and the reason. An accepted tunnel relays
client and server bytes unchanged, in this layer (no per-chunk addon hook: that path made mitmproxy's TCP
relay slow), counting every byte in both directions against the sandbox's ledger; a client chunk that
would cross `outbound_bytes_max` is dropped and the connection aborted (budgets.py's rule for raw TCP).
Revocation aborts the connection like any other (revocation.py). When both sides are closed, one outcome
record (bytes, duration, `egressgate.tls` = `passthrough`, the SNI) follows the CONNECT's allow record,
under its request id. Nothing inside the TLS is checked: no Host, method, path, credential, or response.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

from mitmproxy import tcp
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.tcp import TcpStartHook
from mitmproxy.tls import ClientHello

from egressgate.audit.build import build
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.gateway.context import ConnState, Runtime, new_request_id
from egressgate.gateway.deny import gateway_deny
from egressgate.gateway.record import conn_attributes
from egressgate.gateway.tls_limits import ALERT_GRACE, ALERT_ILLEGAL_PARAMETER, HelloScan
from egressgate.policy.canon import CanonError, canon_host, parse_ip_literal
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)

ALERT_ACCESS_DENIED = b"\x15\x03\x03\x00\x02\x02\x31"  # fatal access_denied (RFC 8446 6.2), in clear
SERVER_NAME = 0x0000
# Encrypted ClientHello (RFC 9849) and its draft predecessor ESNI: the real name is not in clear.
ENCRYPTED_NAME = {0xFE0D: "encrypted_client_hello", 0xFFCE: "encrypted_server_name"}
TLS_ATTRIBUTE = {"egressgate.tls": "passthrough"}


def _mismatch(host: str, what: str, detail: str) -> Decision:
    return gateway_deny(
        Reason.HOST_MISMATCH,
        f"This tunnel is a TLS passthrough route to {host}; its ClientHello must carry exactly one SNI "
        f"naming {host} ({what}). Connect with SNI {host}, or open a new CONNECT for another host.",
        detail=detail,
    )


def server_names(body: bytes) -> list[tuple[int, bytes]] | None:
    """The (name_type, name) entries of a server_name extension body (RFC 6066 3); None if malformed."""
    if len(body) < 2 or struct.unpack("!H", body[:2])[0] != len(body) - 2:
        return None
    out, i = [], 2
    while i < len(body):
        if i + 3 > len(body):
            return None
        kind, size = body[i], struct.unpack("!H", body[i + 1:i + 3])[0]
        if i + 3 + size > len(body):
            return None
        out.append((kind, body[i + 3:i + 3 + size]))
        i += 3 + size
    return out


def read_sni(hello: bytes) -> tuple[str | None, str | None]:
    """(SNI, None) for handshake message `hello` carrying exactly one host_name in clear; (None or the raw
    name, problem) otherwise. Parsed here, not with mitmproxy's `ClientHello.sni`, which skips a
    malformed server_name and takes the first good one: a server that reads another would be fronted."""
    if not hello or hello[0] != 1:
        return None, "not_client_hello"
    try:
        extensions = ClientHello(hello[4:]).extensions
    except Exception:  # kaitai raises EOFError, ValueError, its own errors... all mean "not parseable"
        return None, "client_hello_unparseable"
    for kind, _ in extensions:
        if kind in ENCRYPTED_NAME:
            return None, ENCRYPTED_NAME[kind]
    bodies = [bytes(body) for kind, body in extensions if kind == SERVER_NAME]
    if not bodies:
        return None, "sni_missing"
    names = server_names(bodies[0]) if len(bodies) == 1 else None
    if names is None or len(names) != 1 or names[0][0] != 0:
        return None, "sni_ambiguous"
    try:
        return names[0][1].decode("ascii"), None
    except UnicodeDecodeError:
        return names[0][1].decode("latin-1")[:255], "sni_invalid"


def check_hello(hello: bytes, host: str) -> tuple[str | None, Decision | None]:
    """(the SNI, None) when handshake message `hello` is a ClientHello naming `host` (canonical) exactly
    once in clear; (the SNI or None, the deny) otherwise."""
    sni, problem = read_sni(hello)
    if problem == "not_client_hello":
        return None, gateway_deny(Reason.PROTOCOL_NOT_ALLOWED, f"A passthrough route to {host} carries TLS "
                                  "only; the first handshake message was not a ClientHello.", detail=problem)
    if problem == "client_hello_unparseable":
        return None, gateway_deny(Reason.INVALID_REQUEST, "The TLS ClientHello could not be parsed.", detail=problem)
    if problem in ENCRYPTED_NAME.values():
        return None, gateway_deny(
            Reason.PROTOCOL_NOT_ALLOWED,
            f"Encrypted ClientHello hides the server name; a passthrough route to {host} needs the SNI "
            f"in clear. Turn ECH off for this client.", detail=problem)
    if problem == "sni_missing":
        if parse_ip_literal(host) is not None:
            return None, None  # an IP-literal target: clients send no SNI (RFC 6066 3), the pin is the check
        return None, _mismatch(host, "it sent none", problem)
    if problem == "sni_ambiguous":
        return None, _mismatch(host, "it sent several or a malformed one", problem)
    assert sni is not None
    try:
        same = problem is None and canon_host(sni) == host
    except CanonError:
        same, problem = False, "sni_invalid"
    if problem is not None:
        return sni, _mismatch(host, "its SNI is not a valid name", problem)
    if not same:
        return sni, _mismatch(host, f"it named {sni[:255]}", "sni_mismatch")
    return sni, None


def write_behind(rt: Runtime, event: AuditEvent) -> None:
    """An outcome cannot be denied (the bytes moved): written through the sink's retry queue, never
    dropped, and tracked so shutdown drains it (the same rule as record.Record._write_behind)."""
    task = asyncio.get_running_loop().create_task(rt.audit.write_after(event))
    rt.background.add(task)
    task.add_done_callback(rt.background.discard)


class PassthroughLayer(layer.Layer):
    """The whole tunnel after the CONNECT: ClientHello check, then a counting splice (see module doc)."""

    def __init__(self, context, rt: Runtime, conn: ConnState) -> None:
        super().__init__(context)
        self.rt, self.conn = rt, conn
        self.buf = bytearray()
        self.scan = HelloScan()
        self.flow = tcp.TCPFlow(context.client, context.server, live=True)
        self.started_ns = time.time_ns()
        self.sandbox_id = conn.sandbox_id or ""
        self.sni: str | None = None
        self.out = self.in_ = 0
        self.cut = False
        self.refusal: Decision | None = None
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
        if isinstance(event, events.ConnectionClosed):
            self.error = "closed before the ClientHello was complete"
            yield from self._close_all()
            return
        if not isinstance(event, events.DataReceived):
            return
        if event.connection is not self.context.client:  # TLS: the server never speaks first
            yield from self._refuse(gateway_deny(Reason.PROTOCOL_NOT_ALLOWED, "The upstream spoke before the "
                                                 "client's ClientHello; this is not TLS.", detail="server_first"))
            return
        self.buf += event.data
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
        self.sni, refusal = check_hello(bytes(scan.hello), self.conn.tunnel_host)
        self.scan = HelloScan()  # release the copy of the handshake bytes
        if refusal is None and self.conn.closed:
            refusal = gateway_deny(Reason.SANDBOX_REVOKED)
        if refusal is not None:
            yield from self._refuse(refusal)
            return
        # One hook per tunnel, not per chunk: tunnel.py's tcp_start refuses a relay no decision allowed,
        # connguard.py stops the handshake deadline (a relay has only the idle timeout).
        yield TcpStartHook(self.flow)
        if self.flow.error is not None or self.conn.closed:
            yield from self._refuse(gateway_deny(Reason.INTERNAL_ERROR if not self.conn.closed
                                                 else Reason.SANDBOX_REVOKED))
            return
        self._handle_event = self._relay
        first, self.buf = bytes(self.buf), bytearray()
        yield from self._to_server(first)

    def _relay(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived):
            if event.connection is self.context.client:
                yield from self._to_server(event.data)
            else:
                n = len(event.data)
                self.in_ += n
                self.rt.ledger.add_in(self.sandbox_id, n)
                yield commands.SendData(self.context.client, event.data)
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
    def _to_server(self, data: bytes) -> layer.CommandGenerator[None]:
        if self.cut:
            return
        policy = self.rt.policies.get(self.conn.policy_name)
        limit = policy.outbound_bytes_max if policy is not None else 0
        if not self.rt.ledger.try_out(self.sandbox_id, len(data), limit):
            # the chunk that would cross is never relayed; RST both sides (a cut stream must not look
            # complete to the upstream)
            self.cut = True
            logger.info("sandbox %s crossed outbound_bytes_max in a passthrough tunnel; cutting", self.sandbox_id)
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(self.context.client.id)
            return
        self.out += len(data)
        yield commands.SendData(self.context.server, data)

    def _refuse(self, decision: Decision, alert: bytes = ALERT_ACCESS_DENIED) -> layer.CommandGenerator[None]:
        self.refusal = decision
        self.buf = bytearray()
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
        conn = self.conn
        refusal = self.refusal
        if refusal is None and self.cut:
            refusal = gateway_deny(Reason.BUDGET_EXCEEDED, detail="outbound_bytes_max")
        elif refusal is None and conn.closed:
            refusal = gateway_deny(Reason.SANDBOX_REVOKED)
        extra: dict = {**TLS_ATTRIBUTE, **conn_attributes(conn)}
        if self.sni is not None:
            extra["egressgate.tls.sni"] = self.sni
        if refusal is not None and refusal.detail:
            extra["egressgate.detail"] = refusal.detail
        if self.cut:
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
            port=conn.tunnel_port, bytes_out=self.out, bytes_in=self.in_,
            duration_ms=(time.time_ns() - self.started_ns) / 1e6,
            message=refusal.message if refusal is not None else None, extra=extra,
        ))

