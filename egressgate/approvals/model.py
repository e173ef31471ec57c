"""Approvals: a sandbox asked for something outside its allowlist; an operator approves or denies.

Life cycle (every step is an audit record, operation `approval`): `pending` (created by the gateway
when a request is refused `approval_required`) -> `approved` (a time-limited grant for that sandbox
only, scope `host` or `host+path`) or `denied` -> `expired` (an approved grant at `expires_at`, a
pending request nobody decided within PENDING_TTL_SECONDS). Waiting requests are never held open: the
agent retries, and a retry of the same target while it is pending gets the same approval id.

Bounds (a sandbox must not be able to flood the operator's queue): at most MAX_PENDING_PER_SANDBOX
pending approvals per sandbox; past that, refusals carry no new approval. A denied target is remembered
for DENIED_MEMORY_SECONDS: retries get the denial back instead of a fresh request. Denied and expired
approvals are dropped from the store RETENTION_SECONDS after they ended.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass, replace
from enum import StrEnum

from egressgate.approvals.grant import MCP_SCHEME, SCOPE_HOST_PATH, Grant
from egressgate.state.base import StateUnavailable

MAX_PENDING_PER_SANDBOX = 16
PENDING_TTL_SECONDS = 3600.0
DENIED_MEMORY_SECONDS = 3600.0
# a denied or expired approval is dropped from the store this long after it ended (the audit trail keeps
# every step): the store's size is bounded by what sandboxes can ask for in a day, not by uptime
RETENTION_SECONDS = 86400.0
DEFAULT_FOR_SECONDS = 600
MAX_FOR_SECONDS = 86400
MAX_BY_CHARS = 128
KIND_NETWORK_EXPANSION = "network_expansion"
# One MCP tool of one server (egressgate/mcp/mediator.py): stored like a network approval with scheme
# "mcp", host = server name, port 0, method "tools/call", path = tool name (policy/mcp_decide.py reads the
# grant by exactly these fields; port 0 and the scheme keep it from ever covering a network request).
KIND_MCP_TOOL = "mcp_tool"
# A persistent workspace's staged changes (runtimes/persist.py): scheme "workspace", host "workspace:<name>"
# (no canonical host has a colon), port 0, `details` lists every changed path; never a network grant.
KIND_PERSISTENT_WRITE = "persistent_write"
# Operation classes (policy/opclass.py): a request the rules allow that is a package install
# (`execution.package_install: approval`) or a publish (`require_approval_for: [publish]`); the grant lets
# requests of that class through to that scheme://host:port (scope host) or that method and path.
KIND_PACKAGE_INSTALL = "package_install"
KIND_PUBLISH = "publish"
CLASS_KINDS = (KIND_PACKAGE_INSTALL, KIND_PUBLISH)


class ApprovalState(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    EXPIRED = "expired"


class ApprovalNotFound(LookupError):
    pass


class NotPending(RuntimeError):
    """The approval was already decided or expired (HTTP 409 `not_pending`)."""


class ApprovalUnavailable(StateUnavailable):
    """The approval store failed: whoever depends on it denies `state_unavailable`, never allows."""


APPROVAL_ID = re.compile(r"^apr-[0-9a-f]{16}$")


def new_approval_id() -> str:
    return "apr-" + secrets.token_hex(8)


def valid_approval_id(text: str) -> bool:
    """Ids name store keys: anything but our own shape is refused before it reaches the store."""
    return APPROVAL_ID.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class Approval:
    id: str
    sandbox_id: str
    policy: str
    state: ApprovalState
    scheme: str | None
    host: str
    port: int
    method: str | None
    path: str | None
    requested_at: float
    kind: str = KIND_NETWORK_EXPANSION
    decided_at: float | None = None
    decided_by: str | None = None
    scope: str | None = None
    expires_at: float | None = None
    pending_ttl: float = PENDING_TTL_SECONDS  # how long it may stay pending (a persistent write sets its own)
    details: dict | None = None  # what is to be approved beyond the target (persistent_write: the changes)

    @property
    def target_key(self) -> str:
        """What retries are deduplicated on: one pending approval per (sandbox, scheme, host, port); for
        an MCP tool per (sandbox, server, tool), so two tools of one server are two approvals."""
        if self.kind == KIND_MCP_TOOL:
            return f"{MCP_SCHEME}|{self.host}|{self.path}"
        if self.kind in CLASS_KINDS:  # a publish and a network approval of one host are two approvals
            return f"{self.kind}|{self.scheme or '-'}|{self.host}|{self.port}"
        return f"{self.scheme or '-'}|{self.host}|{self.port}"

    def current(self, now: float) -> Approval:
        """The state as of `now`: an approval past its deadline reads `expired` even before the sweeper
        (approvals/sweeper.py) has recorded it."""
        if self.state is ApprovalState.APPROVED and self.expires_at is not None and now >= self.expires_at:
            return replace(self, state=ApprovalState.EXPIRED)
        if self.state is ApprovalState.PENDING and now >= self.requested_at + self.pending_ttl:
            return replace(self, state=ApprovalState.EXPIRED)
        return self

    def ended_at(self) -> float | None:
        """When a denied or expired approval ended (None while it can still change)."""
        if self.state is ApprovalState.DENIED:
            return self.decided_at
        if self.state is ApprovalState.EXPIRED:
            return self.expires_at if self.expires_at is not None else self.requested_at + self.pending_ttl
        return None

    def decided(self, *, approve: bool, by: str | None, scope: str, for_seconds: int, now: float) -> Approval:
        if approve and scope == SCOPE_HOST_PATH and (self.method is None or self.path is None):
            raise ValueError("this approval was asked for at CONNECT (no method or path): approve it with "
                             "scope host")
        if not approve:
            return replace(self, state=ApprovalState.DENIED, decided_at=now, decided_by=by)
        return replace(self, state=ApprovalState.APPROVED, decided_at=now, decided_by=by, scope=scope,
                       expires_at=now + for_seconds)

    def grant(self) -> Grant:
        assert self.state is ApprovalState.APPROVED and self.scope is not None and self.expires_at is not None
        return Grant(id=self.id, sandbox_id=self.sandbox_id, scope=self.scope, scheme=self.scheme,
                     host=self.host, port=self.port, method=self.method, path=self.path,
                     expires_at=self.expires_at, kind=self.kind)

    def to_json(self) -> dict:
        """The API's Approval object (docs/openapi.yaml)."""
        out = asdict(self)
        out["state"] = str(self.state)
        return out

    def to_fields(self) -> dict[str, str]:
        """Flat string fields (the Redis hash); absent = None."""
        out = {k: str(v) for k, v in self.to_json().items() if v is not None}
        if self.details is not None:
            out["details"] = json.dumps(self.details, separators=(",", ":"))
        return out

    @classmethod
    def from_fields(cls, raw: dict[str, str]) -> Approval:
        def opt_float(key: str) -> float | None:
            return float(raw[key]) if key in raw else None

        return cls(id=raw["id"], sandbox_id=raw["sandbox_id"], policy=raw["policy"],
                   state=ApprovalState(raw["state"]), scheme=raw.get("scheme"), host=raw["host"],
                   port=int(raw["port"]), method=raw.get("method"), path=raw.get("path"),
                   requested_at=float(raw["requested_at"]), kind=raw.get("kind", KIND_NETWORK_EXPANSION),
                   decided_at=opt_float("decided_at"), decided_by=raw.get("decided_by"),
                   scope=raw.get("scope"), expires_at=opt_float("expires_at"),
                   pending_ttl=float(raw.get("pending_ttl", PENDING_TTL_SECONDS)),
                   details=json.loads(raw["details"]) if "details" in raw else None)
