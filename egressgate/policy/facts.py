"""Inputs and outputs of the pure decision engine.

Everything here is an immutable value: the gateway, the DNS resolver and `audit replay` build the same
`Facts` and `SandboxState` and must get the same `Decision`, so nothing in these types may refer to a
clock, a socket or a store.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from egressgate.approvals.grant import Grant
from egressgate.policy.reasons import Effect, Reason

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_EMPTY: Mapping[str, str] = MappingProxyType({})


class Operation(StrEnum):
    CONNECT = "connect"  # CONNECT tunnel / transparent TCP accept: host + port only
    HTTP_REQUEST = "http_request"  # one HTTP request (each one on a keep-alive connection / h2 stream)
    DNS_QUERY = "dns_query"


@dataclass(frozen=True, slots=True)
class Facts:
    """The canonical operation. `host` is already canonical (policy.canon.canon_host), `path` canonical
    (policy.canon.canon_path, no query string), `method` upper-case."""

    operation: Operation
    host: str
    port: int | None = None
    scheme: str | None = None  # "https" | "http" | "tcp" (None for CONNECT: not known yet) | "dns"
    method: str | None = None
    path: str | None = None
    addresses: tuple[IPAddress, ...] = ()  # resolved (or literal) addresses the gateway would dial
    qtype: str | None = None  # DNS query type name, e.g. "A"
    query: str | None = None  # the raw query string as sent (no '?'); read only by `query:` rules (querymatch.py)
    request_bytes: int = 0  # size of this request as far as known (for per-rule byte budgets)
    # HTTP requests only: what the request does, recognised by protocol (policy/opclass.py classify()):
    # "package_install" | "publish" | None, and the protocol it was recognised as ("pypi", "npm", "git"...)
    op_class: str | None = None
    op_protocol: str | None = None


@dataclass(frozen=True, slots=True)
class RuleUsage:
    requests: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class SandboxState:
    """What the engine may know about a sandbox's past. Built by the caller from the state store."""

    sandbox_id: str
    admitted_at: float  # unix seconds
    labels: Mapping[str, str] = _EMPTY
    bytes_out: int = 0
    bytes_in: int = 0
    dns_queries: int = 0
    dns_name_bytes: int = 0
    seen_hosts: frozenset[str] = frozenset()  # canonical hosts this sandbox made allowed requests to
    rule_usage: Mapping[str, RuleUsage] = _EMPTY
    # live operator approvals of this sandbox (egressgate/approvals), given only under a policy that
    # requires approval for network_expansion; decide() drops the expired ones by `now`
    approvals: tuple[Grant, ...] = ()
    # The host patterns `seen_hosts` was reduced to (CompiledPolicy.relevant_state: the ones a `when` of the
    # deciding policy asks about): every seen host matching one is in it, no other is. None: not reduced to
    # a scope. decide() never reads it; it is recorded with the state so `audit replay` knows for which hosts
    # the record's `seen_hosts` is the exact answer (docs/audit.md, "Replay").
    seen_scope: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    effect: Effect
    reason: Reason
    rule_id: str | None = None
    capability: str | None = None  # credential capability bound to the matched rule
    detail: str | None = None  # e.g. the address class for address_forbidden
    message: str = ""  # one sentence an agent can act on; never contains secrets
    intercept: bool = True  # CONNECT only: False when only a raw-TCP rule allows the target
    # CONNECT only: the first rule that allows the target has `tls: passthrough` (intercept is then False):
    # the tunnel must carry TLS whose SNI names the target, spliced without interception
    passthrough: bool = False
    # approval_granted: the approval that allowed it; approval_required: the pending approval to ask for
    approval_id: str | None = None
    # approval_required / approval_granted by an operation class: "package_install" | "publish" (None: the
    # network allowlist, approvals kind network_expansion)
    approval_kind: str | None = None

    @property
    def allowed(self) -> bool:
        return self.effect is Effect.ALLOW
