"""In-process approval store (memory state backend, single gateway process).

One event loop: each method runs without an await in its critical part, so it is atomic with respect to
the others, which is what the Redis store gets from its Lua scripts.
"""

from __future__ import annotations

from dataclasses import replace

from egressgate.approvals.grant import Grant
from egressgate.approvals.model import (
    DENIED_MEMORY_SECONDS,
    MAX_PENDING_PER_SANDBOX,
    RETENTION_SECONDS,
    Approval,
    ApprovalNotFound,
    ApprovalState,
    NotPending,
)


class MemoryApprovals:
    def __init__(self) -> None:
        self._all: dict[str, Approval] = {}  # insertion order = request order
        self._pending: dict[str, dict[str, str]] = {}  # sandbox -> target key -> id
        self._denied: dict[str, dict[str, str]] = {}  # sandbox -> target key -> id
        self._grants: dict[str, dict[str, Grant]] = {}  # sandbox -> id -> grant

    async def request(self, draft: Approval, now: float) -> tuple[Approval | None, bool]:
        key = draft.target_key
        pending = self._pending.setdefault(draft.sandbox_id, {})
        for target, approval_id in list(pending.items()):  # drop what is no longer pending
            if self._all[approval_id].current(now).state is not ApprovalState.PENDING:
                del pending[target]
        if key in pending:
            return self._all[pending[key]], False
        denied_id = self._denied.get(draft.sandbox_id, {}).get(key)
        if denied_id is not None:
            denied = self._all[denied_id]
            if denied.decided_at is not None and now < denied.decided_at + DENIED_MEMORY_SECONDS:
                return denied, False
            del self._denied[draft.sandbox_id][key]
        if len(pending) >= MAX_PENDING_PER_SANDBOX:
            return None, False
        self._all[draft.id] = draft
        pending[key] = draft.id
        return draft, True

    async def get(self, approval_id: str) -> Approval | None:
        return self._all.get(approval_id)

    async def list(self, state: ApprovalState | None, now: float) -> list[Approval]:
        current = (a.current(now) for a in self._all.values())
        return [a for a in current if state is None or a.state is state]

    async def decide(self, approval_id: str, *, approve: bool, by: str | None, scope: str, for_seconds: int,
                     now: float) -> Approval:
        approval = self._all.get(approval_id)
        if approval is None:
            raise ApprovalNotFound(approval_id)
        if approval.current(now).state is not ApprovalState.PENDING:
            raise NotPending(approval_id)
        decided = approval.decided(approve=approve, by=by, scope=scope, for_seconds=for_seconds, now=now)
        self._all[approval_id] = decided
        self._pending.get(approval.sandbox_id, {}).pop(approval.target_key, None)
        if approve:
            self._grants.setdefault(approval.sandbox_id, {})[approval_id] = decided.grant()
        else:
            self._denied.setdefault(approval.sandbox_id, {})[approval.target_key] = approval_id
        return decided

    async def grants(self, sandbox_id: str, now: float) -> tuple[Grant, ...]:
        return tuple(g for g in self._grants.get(sandbox_id, {}).values() if now < g.expires_at)

    async def consume(self, sandbox_id: str, approval_id: str, now: float) -> Approval | None:
        grant = self._grants.get(sandbox_id, {}).pop(approval_id, None)
        if grant is None or now >= grant.expires_at:
            return None
        used = self._all[approval_id] = replace(self._all[approval_id], state=ApprovalState.EXPIRED, expires_at=now)
        return used

    async def expire(self, now: float) -> list[Approval]:
        out = []
        for approval_id, approval in list(self._all.items()):
            ended = approval.ended_at()
            if ended is not None and now >= ended + RETENTION_SECONDS:  # retention over: forget it
                del self._all[approval_id]
                denied = self._denied.get(approval.sandbox_id, {})
                if denied.get(approval.target_key) == approval_id:
                    del denied[approval.target_key]
                continue
            if approval.state not in (ApprovalState.PENDING, ApprovalState.APPROVED):
                continue
            if approval.current(now).state is not ApprovalState.EXPIRED:
                continue
            expired = self._all[approval_id] = approval.current(now)
            self._grants.get(approval.sandbox_id, {}).pop(approval_id, None)
            pending = self._pending.get(approval.sandbox_id, {})
            if pending.get(approval.target_key) == approval_id:
                del pending[approval.target_key]
            out.append(expired)
        return out

    async def close(self) -> None:
        return None


