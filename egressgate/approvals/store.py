"""The approval store protocol, and the one factory the gateway calls.

Approvals live next to the sandbox registry: in process memory with the memory state backend, in the
same Redis (under the same key prefix) with the Redis backend, so an approval granted through one
replica is honoured by every other and expires everywhere at the same instant. Every method is async
and every backend failure raises ApprovalUnavailable (callers deny, never allow).
"""

from __future__ import annotations

from typing import Protocol

from egressgate.approvals.grant import Grant
from egressgate.approvals.model import Approval, ApprovalState


class ApprovalStore(Protocol):
    async def request(self, draft: Approval, now: float) -> tuple[Approval | None, bool]:
        """The approval a refused request should name: the pending (or recently denied) one for the same
        sandbox and target, else `draft` stored as new (created=True); (None, False) when the sandbox
        already has MAX_PENDING_PER_SANDBOX pending approvals."""

    async def get(self, approval_id: str) -> Approval | None: ...

    async def list(self, state: ApprovalState | None, now: float) -> list[Approval]:
        """Oldest first, states as of `now` (Approval.current)."""

    async def decide(self, approval_id: str, *, approve: bool, by: str | None, scope: str, for_seconds: int,
                     now: float) -> Approval:
        """Atomically pending -> approved|denied. ApprovalNotFound, NotPending (already decided or
        expired by `now`), ValueError (host+path on an approval without a path)."""

    async def grants(self, sandbox_id: str, now: float) -> tuple[Grant, ...]:
        """The sandbox's live grants (expires_at > now)."""

    async def consume(self, sandbox_id: str, approval_id: str, now: float) -> Approval | None:
        """Atomically remove a live grant and end its approval (`expired` as of `now`): a single-use grant
        spent. None when it was already gone (spent by a concurrent request, expired, unknown)."""

    async def expire(self, now: float) -> list[Approval]:
        """Move every approval past its deadline to `expired`; each is returned exactly once, even with
        several gateway processes sweeping the same store (its `expired` audit record)."""

    async def close(self) -> None: ...


def open_approvals(state: object) -> ApprovalStore:
    """Approvals in the same backend as `state`: Redis when it is a RedisState (its client and key
    prefix), memory otherwise."""
    redis = getattr(state, "redis", None)
    key = getattr(state, "key", None)
    if redis is not None and callable(key):
        from egressgate.approvals.redis_store import RedisApprovals

        def count_error() -> None:
            state.errors = getattr(state, "errors", 0) + 1  # type: ignore[attr-defined]

        return RedisApprovals(redis, key, count_error)
    from egressgate.approvals.memory import MemoryApprovals

    return MemoryApprovals()
