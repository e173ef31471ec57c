"""The one module of the gateway that hands audit records to the sink (records are built by
audit/build.py; the stages decide what goes into them).

Three ways, by what the record is for:
- `write`: a decision record, before the decision takes effect ("intent before effect"). Returns only
  once the record is durable; raises `AuditUnavailable` when it cannot be, and the caller denies.
- `write_after`: the record of something that already happened, awaited (True: durable now, False:
  queued and retried). Never raises, never drops.
- `write_behind`: the same, without waiting (see its docstring).

Every gateway file asks this module; tests/architecture/test_one_emitter.py fails when another one
calls the sink's write methods itself. It also holds the connection attributes several records repeat
(`conn_attributes`), so no stage needs another stage's module to describe a connection, and the flow's
decision and outcome records (`flow_decision_event`, `write_owed`, `write_outcome`), which Record writes
and the MCP route folds into its calls' records (docs/audit.md "MCP"): two stages, one definition.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from egressgate.audit.build import build
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.gateway.shared import request_hash
from egressgate.gateway.shared.sources import CHALLENGE
from egressgate.policy.reasons import Reason

if TYPE_CHECKING:
    from mitmproxy import http

    from egressgate.gateway.shared.context import ConnState, FlowState, Runtime


async def write(rt: Runtime, event: AuditEvent) -> None:
    """A decision record: durable when this returns; raises AuditUnavailable when it cannot be."""
    await rt.audit.write(event)


async def write_after(rt: Runtime, event: AuditEvent) -> bool:
    """The record of something that already happened, awaited: True when durable now, False when it was
    queued for a retry (never dropped, never raises)."""
    return await rt.audit.write_after(event)


def write_behind(rt: Runtime, event: AuditEvent) -> None:
    """The one way to write a record of something that already happened, without waiting for it.

    Outcome records (and a refusal that takes effect whether or not its record is written) are written
    without holding the response: intent-before-effect is the decision record's job, and it was durable
    before anything went upstream. Such a record cannot be denied (the exchange happened) and may hold the
    only request hash of a streamed body, so it goes through the sink's `enqueue_after`: a failed write is
    queued and retried, never dropped (the sink logs the request id; a full retry queue makes the sink
    unhealthy, so *new* requests are denied), and the sink's close() drains it. No task per record (one
    per request was ~2 % of the gateway's CPU at c=1, issue 11)."""
    rt.audit.enqueue_after(event)


def transparent_attributes(transparent: bool, original_dst: tuple[str, int] | None) -> dict[str, str]:
    """`egressgate.mode` = `transparent` (and the address the sandbox dialed) for a connection on the
    transparent listener; nothing for the explicit proxy (its records are unchanged)."""
    if not transparent:
        return {}
    out = {"egressgate.mode": "transparent"}
    if original_dst is not None:
        host, port = original_dst
        out["egressgate.original_dst"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return out


def conn_attributes(conn: ConnState | None) -> dict[str, str]:
    return transparent_attributes(conn.transparent, conn.original_dst) if conn is not None else {}


def decision_event(kind: EventKind, fs: FlowState, labels: dict[str, str], client: str | None) -> AuditEvent:
    """The flow's decision record (CONNECT or HTTP request)."""
    d = fs.decision
    assert d is not None
    extra: dict = transparent_attributes(fs.transparent, fs.original_dst)
    if fs.intercept is not None:
        extra["egressgate.intercept"] = fs.intercept
    if d.passthrough:
        extra["egressgate.tls"] = "passthrough"
    if fs.budget_refused is not None and not d.allowed:  # what the byte budget check read (audit replay)
        extra["egressgate.budget.needed"], extra["egressgate.budget.spent"] = fs.budget_refused
    challenge = d.reason is Reason.IDENTITY_UNKNOWN and d.detail == CHALLENGE  # identity.py: asked, not refused
    return build(
        kind,
        time_ns=fs.started_ns,
        request_id=fs.request_id,
        verdict=d,
        sandbox_labels=labels,
        extra=extra,
        decision="challenge" if challenge else str(d.effect),
        sandbox_id=fs.sandbox_id,
        policy_name=fs.policy_name,
        policy_hash=fs.policy_hash,
        target_as_sent=fs.target_as_sent,
        scheme=fs.scheme,
        host=fs.host,
        port=fs.port,
        method=fs.method,
        path=fs.path,
        query=fs.query,
        pinned_address=str(fs.pinned.address) if fs.pinned is not None else None,
        client_address=client,
        key_id=fs.key_id,
        bytes_out=fs.bytes_out if fs.prepaid_out else None,
        facts=fs.facts,
        state=fs.state,
        request_hash=fs.bodyless_hash,
    )


def outcome_event(fs: FlowState, **fields) -> AuditEvent:
    """An outcome record of the flow's allowed decision (same request id); `fields` say what happened."""
    return build(
        EventKind.OUTCOME,
        request_id=fs.request_id,
        sandbox_id=fs.sandbox_id,
        policy_name=fs.policy_name,
        policy_hash=fs.policy_hash,
        host=fs.host,
        port=fs.port,
        duration_ms=(time.time_ns() - fs.started_ns) / 1e6,
        **fields,
    )


def mark_transparent(conn: ConnState | None, fs: FlowState) -> None:
    if conn is not None and conn.transparent:
        fs.transparent, fs.original_dst = True, conn.original_dst


def flow_decision_event(
    rt: Runtime, flow: http.HTTPFlow, fs: FlowState, kind: EventKind = EventKind.HTTP_REQUEST
) -> AuditEvent:
    """The flow's decision record, with the connection's labels, client address and mode."""
    conn = rt.conns.get(flow.client_conn.id)
    client = flow.client_conn.peername[0] if flow.client_conn.peername else None
    mark_transparent(conn, fs)
    return decision_event(kind, fs, conn.labels if conn is not None else {}, client)


def write_owed(rt: Runtime, flow: http.HTTPFlow, fs: FlowState) -> None:
    """The deferred decision record of an MCP POST that nothing folded (pipeline/record.py Record._owed),
    written behind: the flow ends or is refused without anything having gone upstream on it."""
    if fs.record_owed:
        fs.record_owed = False
        write_behind(rt, flow_decision_event(rt, flow, fs))


def write_outcome(
    rt: Runtime, flow: http.HTTPFlow, fs: FlowState, error: str | None = None, more: dict | None = None
) -> None:
    """The outcome record of an allowed flow, once, written behind; `more`: attributes of the exchange
    another stage adds (the MCP route: its call's outcome, one record per call, docs/audit.md "MCP")."""
    event = flow_outcome_event(rt, flow, fs, error, more)
    if event is not None:
        write_behind(rt, event)


def flow_outcome_event(
    rt: Runtime, flow: http.HTTPFlow, fs: FlowState, error: str | None = None, more: dict | None = None
) -> AuditEvent | None:
    """What `write_outcome` writes, built once (None: not an allow, or already built); the caller writes it.
    The MCP route holds an HTTP+SSE POST's until its call's answer arrives on the stream (one outcome
    record per call)."""
    if fs.outcome_sent or fs.decision is None or not fs.decision.allowed:
        return None
    fs.outcome_sent = True
    write_owed(rt, flow, fs)  # an MCP POST that ended before its route recorded it
    extra: dict = transparent_attributes(fs.transparent, fs.original_dst)
    if more:
        extra.update(more)
    for key, value in (
        ("egressgate.error", error),
        ("egressgate.budget_cut", fs.budget_cut),
        ("egressgate.internal_error", fs.internal_error),  # the hook that crashed
        # credential_response.py: why the body was not forwarded
        ("egressgate.response_refused", fs.response_refused),
        # http1_framing.py: the request body's framing was refused
        ("egressgate.request_refused", fs.request_refused),
    ):
        if value:
            extra[key] = value
    req_hash, body_hash = request_hash.finish(fs)
    return outcome_event(
        fs,
        decision="deny" if fs.state_cut else str(fs.decision.effect),  # the store failed mid-body
        reason=str(Reason.STATE_UNAVAILABLE)
        if fs.state_cut
        else str(Reason.BUDGET_EXCEEDED)
        if fs.budget_cut
        else str(fs.decision.reason),
        rule_id=fs.decision.rule_id,
        status=flow.response.status_code if flow.response is not None else None,
        bytes_out=fs.bytes_out,
        bytes_in=fs.bytes_in,
        request_hash=req_hash,
        body_hash=body_hash,
        extra=extra,
    )
