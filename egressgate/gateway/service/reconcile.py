"""The ledger's periodic work: settle idle leases here, reconcile the leases of dead workers everywhere.

Every gateway process runs `run` (started by app.py). Each second it sweeps this process's ledger (pools
left holding bytes without use go back to the store: ledger.ByteLedger.sweep). Every RECONCILE_INTERVAL
it asks the store to reconcile: the outstanding leases of every worker whose heartbeat expired (a process
killed mid-stream, a host that vanished) are removed from the store's lease records. Their bytes stay
spent — they may have gone out before the worker died, so giving them back could let the sandbox exceed
its budget — and the store reports each forfeited lease exactly once, even when several replicas
reconcile at the same time (PLAN-12: the store's contract). Each is audited here as one
`budget_reconcile` record (written after the fact: queued and retried by the sink, never dropped).

A store outage skips a round (logged); the leases wait for the next one, nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging

from egressgate.audit.build import build
from egressgate.audit.event import EventKind
from egressgate.gateway.shared import emit
from egressgate.gateway.shared.context import Runtime
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)

SWEEP_INTERVAL = 1.0
RECONCILE_INTERVAL = 5.0


async def reconcile_once(rt: Runtime) -> int:
    """One reconcile round; returns how many forfeited leases were audited."""
    forfeited = await rt.state.reconcile(rt.clock())
    for worker_id, sandbox_id, amount in forfeited:
        logger.warning("worker %s died holding %d bytes of %s's outbound budget; they stay spent",
                       worker_id, amount, sandbox_id)
        await emit.write_after(rt, build(
            EventKind.BUDGET_RECONCILE, sandbox_id=sandbox_id, bytes_out=amount,
            message=(f"Gateway worker {worker_id} stopped while holding {amount} bytes of this sandbox's "
                     "outbound budget; those bytes stay spent."),
            extra={"egressgate.worker_id": worker_id, "egressgate.forfeited_bytes": amount,
                   "egressgate.reconciled_by": getattr(rt.state, "worker_id", "")},
        ))
    return len(forfeited)


async def run(rt: Runtime, sweep_interval: float = SWEEP_INTERVAL,
              reconcile_interval: float = RECONCILE_INTERVAL) -> None:
    """Until cancelled (ledger.flush at stop): sweep every `sweep_interval`, reconcile every
    `reconcile_interval`. Nothing but cancellation ends it."""
    loop = asyncio.get_running_loop()
    next_reconcile = loop.time()
    while True:
        await asyncio.sleep(sweep_interval)
        try:
            rt.ledger.sweep()
            if loop.time() >= next_reconcile:
                next_reconcile = loop.time() + reconcile_interval
                await reconcile_once(rt)
        except StateUnavailable as exc:
            logger.error("budget reconcile skipped, the state store is unavailable: %s", exc)
        except Exception:
            logger.exception("budget sweep/reconcile failed; trying again next round")


def start(rt: Runtime) -> asyncio.Task:
    """Start `run` for this gateway; the ledger's flush() (at stop) cancels it."""
    task = asyncio.get_running_loop().create_task(run(rt), name="budget-reconcile")
    rt.ledger.periodic = task
    return task
