"""Expire approvals on time and audit each expiry exactly once.

decide() already ignores a grant from its `expires_at` on (it gets `now`), so enforcement never waits
for this loop; the sweeper moves dead approvals to `expired` in the store and writes their `expired`
records. The store's `expire()` hands each approval to exactly one caller, so every gateway process
(workers, replicas) may sweep at once. Like every other approval record, an `expired` one names the
sandbox's labels (`labels_of`: the registry's; none when the sandbox is gone or the registry cannot
answer, so a registry outage never holds an expiry record back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from egressgate.approvals.audit import approval_event
from egressgate.approvals.model import Approval
from egressgate.approvals.store import ApprovalStore
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)
SWEEP_INTERVAL = 0.5  # seconds; an expiry record lags the expiry instant by at most this much


LabelsOf = Callable[[str], Awaitable[Mapping[str, str] | None]]


async def sweep_once(store: ApprovalStore, audit, clock: Callable[[], float],
                     on_expired: Callable[[Approval], Awaitable[None]] | None = None,
                     labels_of: LabelsOf | None = None) -> int:
    expired = await store.expire(clock())
    for approval in expired:
        labels = await labels_of(approval.sandbox_id) if labels_of is not None else None
        audit.enqueue_after(approval_event(approval, "expired", labels))  # queued and retried, never dropped
        if on_expired is not None:  # e.g. a persistent write's staged copy is discarded
            await on_expired(approval)
    return len(expired)


async def sweep_forever(store: ApprovalStore, audit, clock: Callable[[], float],
                        interval: float = SWEEP_INTERVAL,
                        on_expired: Callable[[Approval], Awaitable[None]] | None = None,
                        labels_of: LabelsOf | None = None) -> None:
    failing = False  # log a store outage once, and its end, not every half second
    while True:
        try:
            await sweep_once(store, audit, clock, on_expired, labels_of)
            if failing:
                logger.warning("approval sweeper: the approval store answers again")
            failing = False
        except StateUnavailable as exc:  # the store recovers by itself; expiry is enforced by decide()
            if not failing:
                logger.warning("approval sweeper: %s (expiry records wait until it answers)", exc)
            failing = True
        except Exception:
            logger.exception("approval sweeper failed")
        await asyncio.sleep(interval)
