"""Observe every record an audit sink accepts: the one tap that /metrics (admin/metrics.py) and the
console's live feed (admin/ui/live.py) both use.

The sink's three write methods are replaced on the sink object itself (not a wrapper object), so every
holder of the sink (the gateway addons, the DNS resolver, the admin API) goes through them, and attributes
set on the sink elsewhere still reach the real object. The methods are wrapped ONCE per sink; each
observer is registered under a name, and installing again under the same name only swaps that observer,
so a record is never seen twice by one observer (no double counting).

When a record counts as written (the same rule for every observer):
- `write` is observed once it returned: the record is durable. A write that raised was not recorded (the
  request was denied `audit_unavailable` and the sink's failure counter says so), so it is not observed.
- `write_after`/`enqueue_after` records are never dropped by the sink, so they are observed at once.

Observers run on the event loop for every record, in the writer's call: they must be cheap and must not
block (the live feed only ever `put_nowait`s into bounded queues).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from egressgate.audit.event import AuditEvent

Observer = Callable[[AuditEvent], None]


def observe_writes(sink: Any, name: str, observe: Observer) -> None:
    """Make `observe` see every event the sink accepts (rules in the module docstring). Installing again
    under the same `name` replaces that observer; other names keep theirs."""
    observers: dict[str, Observer] | None = getattr(sink, "_write_observers", None)
    if observers is not None:
        observers[name] = observe
        return
    observers = sink._write_observers = {name: observe}
    write, write_after, enqueue_after = sink.write, sink.write_after, sink.enqueue_after

    def notify(event: AuditEvent) -> None:
        for fn in tuple(observers.values()):
            fn(event)

    async def observed_write(event: AuditEvent) -> None:
        await write(event)
        notify(event)

    async def observed_write_after(event: AuditEvent) -> bool:
        durable = await write_after(event)
        notify(event)
        return durable

    def observed_enqueue_after(event: AuditEvent) -> None:
        enqueue_after(event)
        notify(event)

    sink.write, sink.write_after, sink.enqueue_after = observed_write, observed_write_after, observed_enqueue_after
