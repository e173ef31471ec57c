"""Shared runtime services and per-connection state of the gateway.

mitmproxy calls each addon with a flow or a connection, never with "our" objects, so the addons share
one `Runtime` (config, policies, state store, audit sink, resolver, byte ledger, listeners) and keep
what they learned about a client connection (sandbox, CONNECT target, pinned address, SNI verdict) in a
`ConnState` keyed by the mitmproxy client connection id. Facts that must agree across hooks (the
CONNECT target, the checked address) are written once here and read everywhere else, so no hook ever
re-derives a destination from attacker-controlled headers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from egressgate.approvals.memory import MemoryApprovals
from egressgate.approvals.store import ApprovalStore
from egressgate.audit.build import new_request_id
from egressgate.config import GatewayConfig
from egressgate.policy.facts import Decision, Facts, IPAddress, SandboxState

if TYPE_CHECKING:
    from egressgate.audit.reqhash import StreamingRequestHash
    from egressgate.audit.sink import AuditSink
    from egressgate.broker.broker import Broker
    from egressgate.gateway.mcp.sessions import McpExchange
    from egressgate.gateway.service.resolver import Resolver
    from egressgate.gateway.shared.compose import AnswerFilter, ScrubPlan
    from egressgate.gateway.shared.flowtypes import Applied, LimitRecords, WsRefusal
    from egressgate.gateway.shared.ledger import ByteLedger, Meter
    from egressgate.state.base import SandboxRecord, StateStore

# The one flow.metadata key the gateway uses: it holds the flow's FlowState (every other per-flow fact
# is a typed field of it, so no stage reads a fact another stage never wrote under a misspelt key).
META = "egressgate"


@dataclass(slots=True)
class PinnedTarget:
    """A destination that passed the decision and the address check: dial `address`, present `sni`."""

    host: str  # canonical name (or IP literal text)
    port: int
    address: IPAddress
    sni: str | None  # None for IP literal targets (RFC 6066: no IP in SNI)


@dataclass(slots=True)
class ConnState:
    """What the gateway knows about one client connection (one CONNECT tunnel or one plain proxy conn)."""

    client_id: str
    sandbox_id: str | None = None
    policy_name: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # CONNECT tunnel (None for plain absolute-form proxy connections)
    tunnel_host: str | None = None  # canonical
    tunnel_port: int | None = None
    tunnel_as_sent: str | None = None
    tunnel_target: PinnedTarget | None = None
    intercept: bool = True
    # `tls: passthrough` tunnel (passthrough.py): the ClientHello must name tunnel_host, then bytes are
    # spliced unread; also a relay in the tcp_allowed_rule sense (allow_tcp records its rule and id)
    passthrough: bool = False
    sni_mismatch: str | None = None  # the offending SNI, when it does not name the CONNECT target
    tcp_allowed_rule: str | None = None  # rule id when raw TCP in this tunnel was allowed
    # request id of the decision that allowed that raw TCP (the CONNECT's, or the in-tunnel raw-TCP
    # decision's): the relay's outcome record reuses it, so `audit find --request-id` links the two
    tcp_request_id: str | None = None
    # address tuple (as mitmproxy will present it in server_connect) -> checked target; written only by
    # pinning.py (commit), read only by pinning.py (server_connect / server_connected)
    approved: dict[tuple[str, int], PinnedTarget] = field(default_factory=dict)
    closed: bool = False
    # identity.py: the Proxy-Authorization value that bound this plain-proxy connection (already verified;
    # never in a repr, it holds the sandbox's token)
    proxy_auth: str | None = field(default=None, repr=False)
    # transparent listener (transparent.py): identity is the source address, the name the SNI or Host
    transparent: bool = False
    original_dst: tuple[str, int] | None = None  # what the sandbox dialed (SO_ORIGINAL_DST): never dialed
    refusal: Decision | None = None  # every request on this transparent connection gets this deny
    refusal_id: str | None = None  # request id of the record of that refusal, when one was written
    # refused_tunnel.py: an explicit CONNECT refused but accepted to deliver its deny inside (refusal and
    # refusal_id are that CONNECT's); the target it named. Such a tunnel is never bound nor forwarded.
    refused_target: tuple[str, int] | None = None

    def allow_tcp(self, rule_id: str | None, request_id: str) -> None:
        """Raw TCP in this tunnel was allowed by `rule_id` in the decision recorded as `request_id`."""
        self.tcp_allowed_rule = rule_id
        self.tcp_request_id = request_id


@dataclass(slots=True)
class FlowState:
    """Everything the pipeline learns about one flow (an HTTP request, a CONNECT, a websocket session or
    a raw-TCP relay), as typed fields. Each group is written by one stage (named in its comment) and
    only read by the later ones; the audit stage turns it into the flow's records (audit/build.py)."""

    request_id: str
    started_ns: int
    # identity.py / transparent.py: who is asking
    sandbox_id: str | None = None
    policy_name: str | None = None
    # consistency.py / decision.py (target.py for refused flows): what was asked, as sent and canonical
    target_as_sent: str | None = None
    scheme: str | None = None
    host: str | None = None
    port: int | None = None
    method: str | None = None
    path: str | None = None
    query: str | None = None
    # decision.py: the verdict and exactly the inputs decide() saw (recorded for `audit replay`);
    # later stages may only turn an allow into a deny, never the reverse
    policy_hash: str | None = None
    decision: Decision | None = None
    facts: Facts | None = None
    state: SandboxState | None = None
    intercept: bool | None = None  # CONNECT only: False when only a raw-TCP rule allowed the tunnel
    # pinning: the checked destination, and the address mitmproxy will ask to dial for this flow
    pinned: PinnedTarget | None = None
    dial_key: tuple[str, int] | None = None
    # budgets.py: bytes of this flow (HTTP exchange, raw-TCP relay; ws_* the websocket session after the 101)
    bytes_out: int = 0
    bytes_in: int = 0
    prepaid_out: int = 0  # bytes reserved up front (head + Content-Length)
    prepay_committed: bool = False  # ... and past the last refund: they stay spent (counters.finish_flow)
    history_written: bool = False  # budgets.py entered the request into the history with its prepayment
    meter: Meter | None = None  # bytes of unknown total (body, websocket, raw TCP) paid from the lease
    stream_request: bool = False  # the request body is relayed as it arrives (large or of unknown length) ...
    meter_request: bool = False  # ... and counted chunk by chunk (unknown length: not prepaid)
    budget_cut: bool = False
    # the byte budget refused the request before it went upstream: (bytes it needed, bytes already spent or
    # leased), the inputs of that check, recorded for `audit replay` (egressgate.budget.needed / .spent)
    budget_refused: tuple[int, int] | None = None
    state_cut: bool = False  # cut because the state store failed while the stream waited for its lease
    ws_out: int = 0
    ws_in: int = 0
    # streaming.py: the response body is relayed as it arrives (compose.py builds its callable)
    stream_response: bool = False
    # credentials.py: the credential placed on this request (its response is scrubbed of it) and, from
    # credential_response.py, how its streamed body is scrubbed or what replaces a refused one
    credential: Applied | None = None
    scrub: ScrubPlan | None = None
    replacement: bytes | None = None
    # request_hash.py: the canonical request hash (complete at the headers, or fed by the body)
    bodyless_hash: str | None = None
    hash_fields: tuple | None = None  # the canonical fields `bodyless_hash` hashed (start() reuses them)
    hasher: StreamingRequestHash | None = None
    # mcp/route.py: this flow is on a remote MCP route (its server, session, gateway answers) and, for
    # compose.py, what the route adds to the body callables: a body refused on a request that may carry
    # none (called once, at its first byte), and the filter over a streamed answer
    mcp: McpExchange | None = None
    forbid_body: Callable[[], None] | None = None
    answer_filter: AnswerFilter | None = None
    # connguard.py: this request is counted in its connection's in-flight requests
    in_flight: bool = False
    # ws_layer.py: the websocket runs on the guarded layer / why the gateway closed it
    ws_guarded: bool = False
    ws_refusal: WsRefusal | None = None
    # why an allowed exchange did not complete normally (the outcome record says so)
    internal_error: str | None = None  # failclosed.py: the hook that crashed
    response_refused: str | None = None  # credential_response.py / http_layer.py
    request_refused: str | None = None  # http_layer.py: the request body's framing was refused
    # record.py: connection facts repeated on every record of the flow, and what was already written
    transparent: bool = False
    original_dst: tuple[str, int] | None = None
    audited: bool = False
    # an MCP POST's decision record is owed (pipeline/record.py deferred it: the route folds it into the call's
    # `mcp_tool_call` record, or writes it before anything goes upstream); `audited` is already set
    record_owed: bool = False
    outcome_folded: bool = False  # mcp/route.py writes the outcome, with its call's (emit.write_outcome)
    outcome_sent: bool = False
    ws_audited: bool = False

    @property
    def key_id(self) -> str | None:
        """Key id of the placed credential (records carry it, never the value)."""
        return self.credential.credential.key_id if self.credential is not None else None


class PolicyHolder:
    """The live policy set, swapped atomically on reload (one attribute assignment)."""

    def __init__(self, policies: dict[str, Any]) -> None:
        self.policies = policies

    def get(self, name: str | None) -> Any | None:
        return self.policies.get(name) if name else None

    def replace(self, policies: dict[str, Any]) -> None:
        self.policies = policies


@dataclass(slots=True)
class Runtime:
    config: GatewayConfig
    policies: PolicyHolder
    state: StateStore
    audit: AuditSink
    resolver: Resolver
    ledger: ByteLedger
    upstream_bundle: str | None = None
    sandbox_bundle: str | None = None
    listeners: list[tuple[str, int]] = field(default_factory=list)  # every socket we serve on
    proxy_url_host: str = "127.0.0.1"
    proxy_port: int = 0
    dns_address: str | None = None  # "host:port" of the DNS resolver, handed to sandboxes at admission
    conns: dict[str, ConnState] = field(default_factory=dict)
    by_sandbox: dict[str, set[str]] = field(default_factory=dict)
    clock: Callable[[], float] = time.time
    abort_connection: Callable[[str], bool] | None = None  # set by the master: client id -> aborted?
    abort_connection_later: Callable[[str, float], bool] | None = None  # the same, in n seconds
    server_task: Callable[[str, Any], Any] | None = None  # set by the master: (client id, server) -> Task
    broker: Broker | None = None  # credential broker (egressgate/broker); None: credentialed routes fail closed
    background: set[asyncio.Task] = field(default_factory=set)  # write-behind audit records, drained at stop
    # set by connguard.py: audits an oversized request head (client id, source, bytes) -> request id
    header_overflow: Callable[[str, str, int], str] | None = None
    # set by connguard.py: the rate-limited audit of limit events (limit_audit.py), for other layers
    limit_audit: LimitRecords | None = None
    # operator approvals (egressgate/approvals): app.py puts them in the state backend's store
    approvals: ApprovalStore = field(default_factory=MemoryApprovals)

    def conn(self, client_id: str) -> ConnState:
        state = self.conns.get(client_id)
        if state is None:
            state = self.conns[client_id] = ConnState(client_id=client_id)
        return state

    def bind_sandbox(self, conn: ConnState, record: SandboxRecord) -> None:
        conn.sandbox_id = record.id
        conn.policy_name = record.policy_name
        conn.labels = dict(record.labels)
        self.by_sandbox.setdefault(record.id, set()).add(conn.client_id)

    def forget(self, client_id: str) -> None:
        state = self.conns.pop(client_id, None)
        if state is not None and state.sandbox_id is not None:
            ids = self.by_sandbox.get(state.sandbox_id)
            if ids is not None:
                ids.discard(client_id)
                if not ids:
                    self.by_sandbox.pop(state.sandbox_id, None)

    def is_self(self, address: IPAddress, port: int) -> bool:
        """True when dialing (address, port) would reach one of our own listeners."""
        for host, lport in self.listeners:
            if lport != port:
                continue
            try:
                lip = ipaddress.ip_address(host)
            except ValueError:
                return True  # unknown listener host: be conservative
            if lip == address or lip.is_unspecified or (lip.is_loopback and address.is_loopback):
                return True
        return False


def flow_state(flow: Any) -> FlowState | None:
    return flow.metadata.get(META)


def ensure_flow_state(flow: Any) -> FlowState:
    state = flow.metadata.get(META)
    if state is None:
        state = FlowState(request_id=new_request_id(), started_ns=time.time_ns())
        flow.metadata[META] = state
    return state
