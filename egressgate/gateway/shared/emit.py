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
(`conn_attributes`), so no stage needs another stage's module to describe a connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from egressgate.audit.event import AuditEvent

if TYPE_CHECKING:
    from egressgate.gateway.shared.context import ConnState, Runtime


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
