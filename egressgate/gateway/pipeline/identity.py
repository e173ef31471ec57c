"""Identify the sandbox behind each CONNECT and each plain proxy request.

Explicit-proxy identity is `Proxy-Authorization: Basic base64(id:token)`. It is checked on the CONNECT
(the tunnel inherits it) and on every absolute-form request; inside a tunnel each request re-reads the
sandbox record so a revocation takes effect on the next request even before the connection is torn
down. Unknown, malformed or revoked identities get 407 with the deny body.

A token is bound to the addresses its sandbox was admitted with (`sandbox run` admits every run with its
/30 address): presented from any other source address it is refused (407 `identity_address_mismatch`,
audited under the token's sandbox with the address it came from), so a token read out of one sandbox is
worthless in another. A sandbox admitted without addresses (`sandbox admit` for an existing container)
is not bound: its token works from anywhere (docs/operations.md, "Admitting sandboxes").

On the transparent listener the identity is the source address (transparent.py binds it when the
connection's first bytes arrive); Proxy-Authorization means nothing there and is never read. DNS
identifies by source address only (dns/resolver.py). So on those two paths a token cannot be presented
at all, and an address speaks only for the sandbox registered at it.
"""

from __future__ import annotations

import base64
import binascii
import logging

from mitmproxy import connection, http

from egressgate.gateway.layers import refused_layers
from egressgate.gateway.shared.context import ConnState, FlowState, Runtime, ensure_flow_state
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.sources import CHALLENGE, NOT_A_PROXY, UNKNOWN_SOURCE, connection_limit, source_text
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason
from egressgate.state.base import SandboxRecord, StateUnavailable, token_matches

logger = logging.getLogger(__name__)

MAX_AUTH_LEN = 1024
UNKNOWN_IDENTITY = ("Send Proxy-Authorization: Basic base64(sandbox_id:token) as given by `egressgate sandbox "
                    "admit`; an id and token the gateway does not know (never admitted, or lost with its state "
                    "store's data) need a new admission.")
RECORD_LOST = ("The gateway's state store no longer has this sandbox's record (its data was lost), so nothing "
               "is allowed for it; ask the operator to admit a new sandbox.")
def address_mismatch(record: SandboxRecord, source: str | None) -> Decision | None:
    """The refusal for a token presented from an address its sandbox was not admitted with; None when
    the record has no addresses (not bound) or the source is one of them. Pure: the caller passes the
    canonical source text (`source_text`)."""
    if not record.addresses or source in record.addresses:
        return None
    return gateway_deny(
        Reason.IDENTITY_ADDRESS_MISMATCH,
        "This sandbox token was admitted for another source address and is not accepted from this one; "
        "use the proxy settings of the sandbox you run in (its own HTTP_PROXY), not another sandbox's.",
        detail=f"token of {record.id} from {source or 'unknown'}; admitted for {', '.join(record.addresses)}")


def parse_proxy_authorization(value: str | None) -> tuple[str, str] | None:
    """`Basic base64(id:token)` → (id, token); None for anything else (other schemes, bad base64)."""
    if not value or len(value) > MAX_AUTH_LEN:
        return None
    scheme, _, param = value.strip().partition(" ")
    if scheme.lower() != "basic" or not param:
        return None
    try:
        decoded = base64.b64decode(param.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    sandbox_id, sep, token = decoded.partition(":")
    if not sep or not sandbox_id or not token:
        return None
    return sandbox_id, token


async def recheck(rt: Runtime, fs: FlowState, conn: ConnState) -> None:
    """A connection already bound to a sandbox: re-read its record, so a revocation takes effect on
    the next request even before the connection is torn down."""
    fs.sandbox_id = conn.sandbox_id
    fs.policy_name = conn.policy_name
    try:
        record = await rt.state.get(conn.sandbox_id) if conn.sandbox_id else None
    except StateUnavailable:
        fs.decision = gateway_deny(Reason.STATE_UNAVAILABLE)
        return
    if record is None:  # bound to it, yet the store has no record: its data was lost (revoking keeps it)
        fs.decision = gateway_deny(Reason.STATE_UNAVAILABLE, RECORD_LOST, detail="sandbox record missing")
    elif record.revoked:
        fs.decision = gateway_deny(Reason.SANDBOX_REVOKED)


class Identity:
    """Addon: sets FlowState.sandbox_id/policy_name or denies with 407."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def _lookup(self, fs: FlowState, values: list[str], client: connection.Client) -> SandboxRecord | None:
        # exactly one: with two, different parsers could pick different identities
        if not values:  # no credentials at all: the 407 asks for them (recorded as a challenge, record.py)
            fs.decision = gateway_deny(Reason.IDENTITY_UNKNOWN, detail=CHALLENGE)
            return None
        creds = parse_proxy_authorization(values[0]) if len(values) == 1 else None
        if creds is None:
            fs.decision = gateway_deny(Reason.IDENTITY_UNKNOWN, UNKNOWN_IDENTITY)
            return None
        sandbox_id, token = creds
        try:
            record = await self.rt.state.get(sandbox_id)
        except StateUnavailable:
            fs.decision = gateway_deny(Reason.STATE_UNAVAILABLE)
            return None
        if record is None or not token_matches(record, token):
            # one answer whatever the cause: a token the store cannot verify (its digest lost with the
            # data) is not told apart from a wrong one, so no client learns which ids once existed
            fs.decision = gateway_deny(Reason.IDENTITY_UNKNOWN, UNKNOWN_IDENTITY)
            return None
        if record.revoked:
            fs.decision = gateway_deny(Reason.SANDBOX_REVOKED)
            return None
        mismatch = address_mismatch(record, source_text(client))
        if mismatch is not None:
            # named in the record (whose token leaked), never bound to the connection
            fs.sandbox_id, fs.policy_name = record.id, record.policy_name
            fs.decision = mismatch
            return None
        return record

    def _bind(self, fs: FlowState, conn: ConnState, record: SandboxRecord) -> bool:
        if conn.sandbox_id is not None and conn.sandbox_id != record.id:
            # One client connection speaks for one sandbox; switching identity mid-connection is refused
            # so revocation and budgets can never be attributed to the wrong sandbox.
            fs.decision = gateway_deny(
                Reason.INVALID_REQUEST, "One proxy connection may carry only one sandbox identity."
            )
            return False
        if conn.sandbox_id is None:
            over = connection_limit(self.rt, record)
            if over is not None:
                fs.sandbox_id = record.id
                fs.policy_name = record.policy_name
                fs.decision = over
                return False
            self.rt.bind_sandbox(conn, record)
        fs.sandbox_id = record.id
        fs.policy_name = record.policy_name
        return True

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        fs = ensure_flow_state(flow)
        conn = self.rt.conn(flow.client_conn.id)
        if conn.transparent:
            # never a way in on the transparent listener: its Proxy-Authorization is not read (http_layer.py
            # answers such a CONNECT before this hook; this is the rule, should that ever change)
            fs.sandbox_id, fs.policy_name = conn.sandbox_id, conn.policy_name
            fs.decision = conn.refusal or gateway_deny(Reason.PROTOCOL_NOT_ALLOWED, NOT_A_PROXY)
            return
        if conn.tunnel_host is not None:
            # CONNECT inside an established tunnel: never a legitimate client behaviour here.
            fs.sandbox_id = conn.sandbox_id
            fs.policy_name = conn.policy_name
            fs.decision = gateway_deny(
                Reason.PROTOCOL_NOT_ALLOWED, "A CONNECT inside a CONNECT tunnel is not allowed."
            )
            return
        record = await self._lookup(fs, flow.request.headers.get_all("proxy-authorization"), flow.client_conn)
        if record is not None:
            self._bind(fs, conn, record)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        fs = ensure_flow_state(flow)
        if fs.decision is not None:
            return
        conn = self.rt.conn(flow.client_conn.id)
        if conn.refused_target is not None:
            refused_layers.answer(fs, conn)  # a refused CONNECT accepted to answer inside: its deny, again
            return
        if conn.transparent:
            # Identity came with the source address (transparent.py); a refused connection (unknown
            # source, revoked, over the limit, a denied name) answers every request with that refusal.
            fs.sandbox_id = conn.sandbox_id
            fs.policy_name = conn.policy_name
            if conn.refusal is not None:
                fs.decision = conn.refusal
            elif conn.sandbox_id is None:
                fs.decision = gateway_deny(Reason.IDENTITY_UNKNOWN, UNKNOWN_SOURCE)
            else:
                await recheck(self.rt, fs, conn)
            return
        if conn.tunnel_host is not None:
            # Identity came with the CONNECT; re-check the record for revocation on every request.
            await recheck(self.rt, fs, conn)
            return
        values = flow.request.headers.get_all("proxy-authorization")
        if conn.sandbox_id is not None and conn.proxy_auth is not None and values == [conn.proxy_auth]:
            # exactly the header that bound this keep-alive connection, verified then: only the record is
            # re-read (revocation), the token is not hashed again; any other value is checked in full
            await recheck(self.rt, fs, conn)
            return
        record = await self._lookup(fs, values, flow.client_conn)
        if record is not None and self._bind(fs, conn, record):
            conn.proxy_auth = values[0]
