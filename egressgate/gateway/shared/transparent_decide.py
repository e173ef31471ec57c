"""Who is behind a transparent connection, and what it may reach (decisions for transparent.py).

The sandbox never said "proxy", so there is no CONNECT and no Proxy-Authorization: the identity is the
client's source address as a runtime registered it at admission (`state.by_address`), and the
destination is the *name* the client presented (TLS SNI, or the Host of the first plain-HTTP request).
That name is decided exactly like a CONNECT target (`Operation.CONNECT`), then resolved and pinned by
the gateway (pinning.py). The original destination IP the client dialed is only ever used as the key
under which mitmproxy will ask to connect; it is never dialed, except where a `tcp` rule allows raw TCP
to exactly that IP:port (judged as an IP literal, with every address check).
"""

from __future__ import annotations

import ipaddress

from mitmproxy import connection

from egressgate.audit.build import build
from egressgate.audit.event import AuditUnavailable, EventKind
from egressgate.gateway.shared.context import ConnState, PinnedTarget, Runtime
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.destination import bind_tunnel, resolve_checked, resolve_target, with_addresses
from egressgate.gateway.shared.emit import conn_attributes, write
from egressgate.gateway.shared.flow_decision import decide_flow
from egressgate.gateway.shared.sources import UNKNOWN_SOURCE, connection_limit, source_text
from egressgate.policy.canon import CanonError, canon_host, split_host_port
from egressgate.policy.facts import Decision, Facts, Operation, SandboxState
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

NO_NAME = ("A transparent connection must name its destination: TLS with SNI, or HTTP with a Host header; "
           "the address alone is not enough.")
_ADDRESS_REASONS = (Reason.METADATA_ENDPOINT, Reason.ADDRESS_FORBIDDEN, Reason.SELF_CONNECTION)


async def identify(rt: Runtime, conn: ConnState, client: connection.Client) -> None:
    """Bind the connection to the sandbox registered for its source address, or set the refusal every
    request on it will get (unknown source, revoked sandbox, over the per-sandbox connection limit).
    Refusals are audited where the connection names its destination (so the record says what was asked)."""
    conn.transparent = True
    source = source_text(client)
    try:
        record = await rt.state.by_address(source) if source is not None else None
    except StateUnavailable:
        conn.refusal = gateway_deny(Reason.STATE_UNAVAILABLE)
        return
    if record is None:
        conn.refusal = gateway_deny(Reason.IDENTITY_UNKNOWN, UNKNOWN_SOURCE)
        return
    refusal = gateway_deny(Reason.SANDBOX_REVOKED) if record.revoked else connection_limit(rt, record)
    if refusal is not None:
        # named in the records, but not counted as one of the sandbox's connections
        conn.sandbox_id, conn.policy_name, conn.labels = record.id, record.policy_name, dict(record.labels)
        conn.refusal = refusal
        return
    rt.bind_sandbox(conn, record)


def canonical_name(raw: str | None) -> tuple[str | None, Decision | None]:
    """The canonical host of an SNI / Host name, or the deny for a missing or unparseable one."""
    if not raw:
        return None, gateway_deny(Reason.INVALID_REQUEST, NO_NAME)
    try:
        return canon_host(raw), None
    except CanonError as exc:
        return None, gateway_deny(Reason.INVALID_REQUEST, f"The destination name is not valid: {exc}")


def host_header_name(raw: str | None, port: int) -> tuple[str | None, Decision | None]:
    """The canonical host a plain-HTTP Host header names. Clients write the port whenever it is not
    the scheme's default (`Host: api.test:8080`), so the port is split off here, not judged as part of
    the name; that it is the dialed port is consistency.py's check, as on the explicit proxy."""
    if not raw:
        return None, gateway_deny(Reason.INVALID_REQUEST, NO_NAME)
    try:
        host, _ = split_host_port(raw, port)
    except CanonError as exc:
        return None, gateway_deny(Reason.INVALID_REQUEST, f"The Host header is not valid: {exc}")
    return host, None


Decided = tuple[Decision, PinnedTarget | None, Facts | None, SandboxState | None]


async def name_decision(rt: Runtime, conn: ConnState, host: str, port: int) -> Decided:
    """Decide the name like a CONNECT target (deny early: a denied name is never resolved), then
    resolve and check every address and pin one. TLS and HTTP by name are intercepted here, or spliced
    when the first allowing rule is `tls: passthrough` (transparent.py's passthrough_name; a passthrough
    name whose ClientHello cannot be spliced is intercepted: checked more, never less), so a name only
    a `tcp` rule allows is refused."""
    decision, facts, snapshot = await connect_decision(rt, conn, host, port)
    if facts is None:
        return decision, None, None, None
    if decision.allowed and not decision.intercept and not decision.passthrough:
        decision = gateway_deny(
            Reason.PROTOCOL_NOT_ALLOWED,
            f"Only a network.tcp rule allows {host}:{port}; on the transparent listener TLS and HTTP are "
            f"always inspected. Use the explicit proxy (CONNECT) for raw TCP by name.",
            rule_id=decision.rule_id)
    if not decision.allowed:
        return decision, None, facts, snapshot
    target, denied, addresses = await resolve_checked(rt, rt.policies.get(conn.policy_name), host, port)
    if denied is not None:  # the record carries what the address check read (audit replay)
        return denied, target, with_addresses(facts, addresses), snapshot
    return decision, target, facts, snapshot


async def connect_decision(rt: Runtime, conn: ConnState, host: str, port: int
                           ) -> tuple[Decision, Facts | None, SandboxState | None]:
    """The pure CONNECT-level decision for a name (no resolution); facts None when it could not be made."""
    policy = rt.policies.get(conn.policy_name)
    if policy is None:
        return gateway_deny(Reason.POLICY_UNAVAILABLE), None, None
    assert conn.sandbox_id is not None and conn.policy_name is not None
    facts = Facts(operation=Operation.CONNECT, host=host, port=port)
    decision, state = await decide_flow(rt, policy, conn.policy_name, conn.sandbox_id, facts)
    return decision, (facts if state is not None else None), state


async def raw_tcp_decision(rt: Runtime, conn: ConnState) -> tuple[str, Decided]:
    """Bytes that are neither TLS nor HTTP carry no name: only a `tcp` rule for the original destination
    IP:port, judged as an IP literal (address classes, allow_private, the gateway's own listeners),
    lets them through. Returns the canonical host text and the decision."""
    assert conn.original_dst is not None
    raw_host, port = conn.original_dst
    host = canon_host(raw_host)
    policy = rt.policies.get(conn.policy_name)
    if policy is None:
        return host, (gateway_deny(Reason.POLICY_UNAVAILABLE), None, None, None)
    assert conn.sandbox_id is not None and conn.policy_name is not None
    literal = ipaddress.ip_address(host)
    facts = Facts(operation=Operation.HTTP_REQUEST, host=host, port=port, scheme="tcp", addresses=(literal,))
    decision, snapshot = await decide_flow(rt, policy, conn.policy_name, conn.sandbox_id, facts, approvals=False)
    if snapshot is None:
        return host, (decision, None, None, None)
    target = None
    if decision.allowed:
        target, refused = await resolve_target(rt, policy, host, port)
        decision = refused or decision
    elif decision.reason not in _ADDRESS_REASONS:
        decision = gateway_deny(
            Reason.PROTOCOL_NOT_ALLOWED,
            f"Only HTTP(S) naming its destination (TLS SNI or Host) is allowed here; no network.tcp rule "
            f"allows raw TCP to {host}:{port}.",
            rule_id=decision.rule_id)
    return host, (decision, target, facts, snapshot)


async def record(rt: Runtime, conn: ConnState, client: connection.Client, request_id: str,
                 decided: Decided, *, host: str | None, port: int | None, as_sent: str | None,
                 scheme: str | None = None) -> Decision:
    """The connection-level record (operation `connect`, `egressgate.mode` = `transparent`) of a name or
    raw-TCP decision; returns the decision to enforce (an allow whose record is not durable is denied)."""
    decision, target, facts, snapshot = decided
    policy = rt.policies.get(conn.policy_name)
    extra = conn_attributes(conn)
    if decision.allowed and decision.passthrough:
        extra["egressgate.tls"] = "passthrough"
    event = build(
        EventKind.CONNECT, request_id=request_id, verdict=decision, sandbox_labels=conn.labels,
        extra=extra, sandbox_id=conn.sandbox_id, policy_name=conn.policy_name,
        policy_hash=policy.hash if policy is not None else None, target_as_sent=as_sent, scheme=scheme,
        host=host, port=port, pinned_address=str(target.address) if target else None,
        client_address=source_text(client), facts=facts, state=snapshot,
    )
    try:
        await write(rt, event)
    except AuditUnavailable:
        return gateway_deny(Reason.AUDIT_UNAVAILABLE)
    return decision


def commit(conn: ConnState, host: str, port: int, as_sent: str | None, target: PinnedTarget) -> None:
    """The name is allowed and recorded: the connection is now bound to it like a CONNECT tunnel, and
    mitmproxy's connection to the original destination will be dialed to the pinned address instead."""
    assert conn.original_dst is not None
    bind_tunnel(conn, host, port, as_sent, target, conn.original_dst)
