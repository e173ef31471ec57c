"""State shared by the gateway's components: the sandbox registry and the counters budgets read.

A protocol with a memory backend (state/memory.py, one process) and a Redis backend (state/redis.py,
several workers and replicas). All methods are async because the Redis backend does I/O; a store error
must surface as StateUnavailable so callers deny (reason state_unavailable) instead of allowing on
missing data. `open_state` (state/__init__.py) picks the backend from the gateway config.

Budget bookkeeping (reserve_out / settle_out / reconcile): bytes are taken from the sandbox's
`outbound_bytes_max` *before* they are sent, as a lease of the worker that took them. A worker settles
what it really sent and gives the rest back; a worker that dies holding a lease never settles, so a
reconciler removes its leases and they stay spent (the bytes may have gone out). Total spent can then
be higher than what was sent, never lower, so the limit is never exceeded.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from egressgate.policy.facts import SandboxState
from egressgate.policy.globs import HostPattern


class StateUnavailable(RuntimeError):
    """The state backend failed; whatever depends on it is denied."""


def hash_token(token: str) -> str:
    """Tokens are stored only as SHA-256 digests so a dump of the store cannot impersonate a sandbox."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(record: SandboxRecord, token: str) -> bool:
    """Constant-time: the comparison must not tell an attacker how much of a guess was right."""
    return hmac.compare_digest(record.token_hash, hash_token(token))


@dataclass(slots=True)
class SandboxRecord:
    id: str
    token_hash: str
    policy_name: str
    admitted_at: float
    labels: dict[str, str] = field(default_factory=dict)
    addresses: tuple[str, ...] = ()  # source addresses (transparent mode / DNS) registered by a runtime
    revoked: bool = False
    phantoms: dict[str, str] = field(default_factory=dict)  # capability -> sha256 of its phantom value


# The largest amount a backend counts exactly (Redis scripts count in Lua doubles). A sandbox picks the
# sizes (a declared Content-Length): a larger one is refused (nothing reserved or recorded), never
# rounded, and never formatted by `%d` into -2^63, which would drive a counter negative.
MAX_AMOUNT = 2**53 - 1


def grant_size(used: int, want: int, minimum: int, limit: int | None) -> int:
    """The reserve_out rule, stated once (the Redis Lua script mirrors it): as much of `want` as fits
    under `limit`, at least `minimum` (capped at `want`), else 0; 0 for a `want` above MAX_AMOUNT."""
    if want <= 0 or want > MAX_AMOUNT:
        return 0
    minimum = max(1, min(minimum, want))
    grant = want if limit is None else min(want, limit - used)
    return grant if grant >= minimum else 0


def rule_budget_allows(requests: int, nbytes_used: int, nbytes: int,
                       requests_max: int | None, bytes_max: int | None) -> bool:
    """The record_request check (the Redis Lua script mirrors it), the same test as policy.decide's
    `_over_budget`: one more request must stay within `requests_max`; the bytes budget refuses once
    it is used up and when this request's bytes would go over it. Never more than MAX_AMOUNT bytes."""
    if nbytes > MAX_AMOUNT:
        return False
    if requests_max is not None and requests + 1 > requests_max:
        return False
    return bytes_max is None or (nbytes_used < bytes_max and nbytes_used + nbytes <= bytes_max)


@dataclass(frozen=True, slots=True)
class RequestGrant:
    """What `reserve_request` did. `refused`: None (the bytes are reserved and the request is in the
    history and its rule's usage), "bytes" (they do not fit under the limit) or "rule" (the rule's budget
    is spent); when refused nothing was reserved or recorded. `bytes_out`: the sandbox's bytes_out (spent
    and leased) as that step left it, the figure of a 429's "only N bytes remain"."""

    refused: str | None
    bytes_out: int


class StateStore(Protocol):
    worker_id: str  # unique per process (uuid4 hex): leases and heartbeats belong to a worker
    errors: int  # operations that raised StateUnavailable (read by /metrics at scrape time)

    async def admit(self, record: SandboxRecord) -> None: ...

    async def get(self, sandbox_id: str) -> SandboxRecord | None: ...

    async def by_address(self, address: str) -> SandboxRecord | None: ...

    async def list_sandboxes(self) -> list[SandboxRecord]: ...

    async def revoke(self, sandbox_id: str) -> bool:
        """Mark revoked; return False when unknown. Every instance's on_revoke callbacks run (Redis:
        within 1 s, by pub/sub), and the record says revoked for whoever reads it later."""

    def on_revoke(self, callback: Callable[[str], None]) -> None:  # callback(sandbox_id)
        ...

    async def snapshot(self, sandbox_id: str, *, history: bool | Collection[HostPattern] = True,
                       rules: Collection[str] | None = None) -> SandboxState:
        """Everything decide() needs about the sandbox's past, as one consistent value. Raises KeyError
        for an unknown sandbox.

        `history` (True: every host seen; False: none; patterns: at least the seen hosts they match) and
        `rules` (None: every rule's usage; else at least these) let a backend skip what the policy
        never reads: pass `history=policy.history_patterns, rules=policy.budgeted_rules`. A backend
        may return more; policy.relevant_state reduces it to exactly what decide() reads. On Redis a
        long history then costs nothing per request (measured: 5000 hosts, 4 ms -> 0.15 ms)."""

    async def reserve_out(self, sandbox_id: str, want: int, minimum: int, limit: int | None) -> int:
        """Atomically take as much of `want` as fits under `limit` (None: all of it), at least
        `minimum`; the grant counts as spent (bytes_out) at once and is this worker's outstanding
        lease. 0 when not even `minimum` fits. Exact under concurrency across processes."""

    async def settle_out(self, sandbox_id: str, spent: int, unused: int) -> None:
        """Of this worker's lease, `spent` bytes were sent (the lease shrinks, bytes_out stays) and
        `unused` go back (lease and bytes_out shrink). Never gives back more than the lease still holds
        (a lease forfeited by reconcile stays spent). After StateUnavailable, do not call it again for
        the same bytes: it may have run, and a second give-back would shrink another flow's lease."""

    async def add_in(self, sandbox_id: str, amount: int) -> None:
        """Count bytes received from upstream (bytes_in)."""

    async def record_request(self, sandbox_id: str, host: str, rule_id: str | None, nbytes: int, *,
                             requests_max: int | None = None, bytes_max: int | None = None) -> bool:
        """Atomically check the rule's budget and remember an allowed request: host history (for
        `when.after_request_to`) and per-rule usage. False, and nothing recorded, when this request
        would take the rule over `requests_max` / `bytes_max` (rule_budget_allows)."""

    async def reserve_request(self, sandbox_id: str, host: str, rule_id: str | None, nbytes: int, want: int,
                              limit: int | None, *, requests_max: int | None = None, bytes_max: int | None = None,
                              add_in: int = 0) -> RequestGrant:
        """`reserve_out(want, want, limit)` (nothing when `want` is 0: this process held the bytes) and
        `record_request(host, rule_id, nbytes, ...)` as ONE atomic step, all or nothing, the bytes checked
        first: what an allowed request with a known size needs before it goes upstream, in one round trip
        on Redis instead of two (issue 25). `add_in` bytes received earlier are counted too (bytes_in),
        whatever the answer: the ledger sends what it summed since its last write with it."""

    async def add_dns_query(self, sandbox_id: str, name_bytes: int) -> tuple[int, int]:
        """Atomically count one DNS query; return the new (queries, name_bytes) totals."""

    async def count_calls(self, sandbox_id: str, keys: Sequence[tuple[str, int | None]]) -> str | None:
        """MCP call budgets (egressgate/mcp/mediator.py): count one call under every (counter key, max)
        of a decision, all or nothing, in one atomic step: None when counted; else the first key that
        is already at its max, and nothing counted. Call counters are their own namespace, apart from
        the rules' usage (a network rule may be named `mcp:x` too: it must not share a counter)."""

    async def call_counts(self, sandbox_id: str, keys: Sequence[str]) -> dict[str, int]:
        """The calls counted so far under each key (0 for a key never counted)."""

    async def refund_calls(self, sandbox_id: str, keys: Sequence[str]) -> None:
        """Give back one counted call per key (the call was refused after counting, e.g. its audit
        record could not be written): never below zero."""

    async def mcp_read(self, sandbox_id: str, server: str,
                       keys: Sequence[str]) -> tuple[dict[str, int], dict[str, str]]:
        """(call_counts(keys), mcp_pins(server)) in one step: what a tool-call decision reads."""

    async def mcp_pin(self, sandbox_id: str, server: str, name: str, value: str) -> str:
        """Trust on first use: store `value` for (sandbox, server, name) unless one is stored already;
        return the stored one (the first ever seen), atomically across workers and replicas."""

    async def mcp_pins(self, sandbox_id: str, server: str) -> dict[str, str]:
        """Every pin recorded for (sandbox, server): name -> value."""

    async def ping(self) -> None:
        """Raise StateUnavailable unless the backend answers (/readyz)."""

    async def reconcile(self, now: float) -> list[tuple[str, str, int]]:
        """For every worker whose heartbeat expired: remove its outstanding leases (they stay spent) and
        return (worker_id, sandbox_id, forfeited_bytes), each exactly once across all reconcilers."""

    async def close(self) -> None: ...
