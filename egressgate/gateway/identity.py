"""Identify the sandbox behind each CONNECT and each plain proxy request.

Explicit-proxy identity is `Proxy-Authorization: Basic base64(id:token)`. It is checked on the CONNECT
(the tunnel inherits it) and on every absolute-form request; inside a tunnel each request re-reads the
sandbox record so a revocation takes effect on the next request even before the connection is torn
down. Unknown, malformed or revoked identities get 407 with the deny body.

On the transparent listener the identity is the source address (transparent.py binds it when the
connection's first bytes arrive); Proxy-Authorization means nothing there and is never read.
"""

from __future__ import annotations

import base64
import binascii
import logging

from mitmproxy import http

from egressgate.gateway.context import ConnState, FlowState, Runtime, ensure_flow_state
from egressgate.gateway.deny import gateway_deny
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason
from egressgate.state.base import SandboxRecord, StateUnavailable, token_matches

logger = logging.getLogger(__name__)

MAX_AUTH_LEN = 1024
NOT_A_PROXY = ("This connection was redirected to the gateway transparently: send requests to the "
               "destination itself (origin-form, with its Host), not CONNECT or absolute-form proxy requests.")
UNKNOWN_SOURCE = ("This source address is not registered to any sandbox; start the workload with "
                  "`egressgate sandbox run` (or admit it with `sandbox admit --address`).")


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


def connection_limit(rt: Runtime, record: SandboxRecord) -> Decision | None:
    """Concurrent connections per sandbox are bounded (limits.max_connections_per_sandbox): one sandbox
    must not exhaust the gateway's sockets and memory for every other sandbox. The refusal is the
    request's decision (429 + Connection: close), audited like any deny."""
    limit = rt.config.limits.max_connections_per_sandbox
    if len(rt.by_sandbox.get(record.id, ())) < limit:
        return None
    return gateway_deny(
        Reason.CONNECTION_LIMIT,
        f"This sandbox already has {limit} open connections through the gateway "
        f"(limits.max_connections_per_sandbox); close or reuse one, then retry.",
        detail="max_connections_per_sandbox")


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
    if record is None or record.revoked:
        fs.decision = gateway_deny(Reason.SANDBOX_REVOKED)


class Identity:
    """Addon: sets FlowState.sandbox_id/policy_name or denies with 407."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def _lookup(self, fs: FlowState, values: list[str]) -> SandboxRecord | None:
        # exactly one: with two, different parsers could pick different identities
        creds = parse_proxy_authorization(values[0]) if len(values) == 1 else None
        if creds is None:
            fs.decision = gateway_deny(Reason.IDENTITY_UNKNOWN)
            return None
        sandbox_id, token = creds
        try:
            record = await self.rt.state.get(sandbox_id)
        except StateUnavailable:
            fs.decision = gateway_deny(Reason.STATE_UNAVAILABLE)
            return None
        if record is None or not token_matches(record, token):
            fs.decision = gateway_deny(Reason.IDENTITY_UNKNOWN)
            return None
        if record.revoked:
            fs.decision = gateway_deny(Reason.SANDBOX_REVOKED)
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
        record = await self._lookup(fs, flow.request.headers.get_all("proxy-authorization"))
        if record is not None:
            self._bind(fs, conn, record)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        fs = ensure_flow_state(flow)
        if fs.decision is not None:
            return
        conn = self.rt.conn(flow.client_conn.id)
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
        record = await self._lookup(fs, values)
        if record is not None and self._bind(fs, conn, record):
            conn.proxy_auth = values[0]
