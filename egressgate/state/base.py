"""State shared by the gateway's components: the sandbox registry and the counters budgets read.

A protocol with a memory backend (state/memory.py) and, later, Redis (several gateway replicas). All
methods are async because the Redis backend does I/O; a store error must surface as StateUnavailable so
callers deny (reason state_unavailable) instead of allowing on missing data.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Protocol

from egressgate.policy.facts import SandboxState


class StateUnavailable(RuntimeError):
    """The state backend failed; whatever depends on it is denied."""


def hash_token(token: str) -> str:
    """Tokens are stored only as SHA-256 digests so a dump of the store cannot impersonate a sandbox."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(record: SandboxRecord, token: str) -> bool:
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


class StateStore(Protocol):
    async def admit(self, record: SandboxRecord) -> None: ...

    async def get(self, sandbox_id: str) -> SandboxRecord | None: ...

    async def by_address(self, address: str) -> SandboxRecord | None: ...

    async def revoke(self, sandbox_id: str) -> bool:
        """Mark revoked; return False when unknown. Subscribers (open connections) are notified."""

    def on_revoke(self, callback) -> None:  # callback(sandbox_id: str) -> None
        ...

    async def snapshot(self, sandbox_id: str) -> SandboxState:
        """Everything decide() needs about the sandbox's past, as one consistent value."""

    async def add_bytes(self, sandbox_id: str, out: int = 0, in_: int = 0) -> tuple[int, int]:
        """Atomically add and return the new (bytes_out, bytes_in) totals."""

    async def record_request(self, sandbox_id: str, host: str, rule_id: str | None, nbytes: int) -> None:
        """Remember an allowed request: host history (for `when.after_request_to`) and per-rule usage."""

    async def add_dns_query(self, sandbox_id: str, name_bytes: int) -> tuple[int, int]:
        """Atomically count one DNS query; return the new (queries, name_bytes) totals."""

    async def close(self) -> None: ...
