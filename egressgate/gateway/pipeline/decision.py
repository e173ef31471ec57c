"""Build canonical facts, decide (shared/flow_decision.decide_flow), and stage the pinned destination.

At CONNECT the decision is host/port level (deny early, never resolve a denied name — a resolver query
is itself an exfiltration channel); inside a tunnel every request (each keep-alive request, each HTTP/2
stream) is decided on its own method, path and scheme against the tunnel's CONNECT target — never
against a header. Resolution and the address check are part of the decision (destination.resolve_target: a
forbidden address is a deny like any other). Each request is also classified by protocol (package
install, publish: policy/opclass.py) from its method, path, query, Content-Type and Accept. Nothing here
commits state: pinning.py commits an allowed destination only after its audit record is durable
(record.py).
"""

from __future__ import annotations

import logging

from mitmproxy import http

from egressgate.gateway.shared.context import FlowState, Runtime, ensure_flow_state
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.destination import resolve_checked, with_addresses
from egressgate.gateway.shared.flow_decision import decide_flow
from egressgate.gateway.shared.sizes import declared_body_size, request_head_size
from egressgate.gateway.shared.target import as_sent, note_target
from egressgate.policy.canon import CanonError, canon_method, canon_path, split_host_port, split_path_query
from egressgate.policy.facts import Facts, Operation
from egressgate.policy.opclass import METHOD_OVERRIDE_HEADERS, classify_overridden
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)


class DecisionAddon:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def _decide(self, fs: FlowState, policy, facts: Facts):
        """The decision (shared/flow_decision.py: snapshot, decide(), approvals), plus exactly the inputs it
        saw for the audit record (and replay); a store that could not answer leaves only the deny."""
        assert fs.sandbox_id is not None and fs.policy_name is not None
        decision, state = await decide_flow(self.rt, policy, fs.policy_name, fs.sandbox_id, facts)
        fs.decision = decision
        if state is not None:
            fs.facts = facts
            fs.state = state
        return decision

    def _policy(self, fs: FlowState):
        policy = self.rt.policies.get(fs.policy_name)
        if policy is None:
            fs.decision = gateway_deny(Reason.POLICY_UNAVAILABLE)
            return None
        fs.policy_hash = policy.hash
        return policy

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        fs = ensure_flow_state(flow)
        fs.target_as_sent = as_sent(flow.request)
        if fs.decision is not None:
            note_target(self.rt, flow, fs)  # an identity deny's record names what was asked for too
            return
        try:
            host, port = split_host_port(fs.target_as_sent, flow.request.port)
        except CanonError as exc:
            fs.decision = gateway_deny(Reason.INVALID_REQUEST, f"Invalid CONNECT target: {exc}")
            return
        fs.host, fs.port = host, port
        policy = self._policy(fs)
        if policy is None:
            return
        facts = Facts(operation=Operation.CONNECT, host=host, port=port)
        if not (await self._decide(fs, policy, facts)).allowed:
            return
        allowed = fs.decision
        target, denied, addresses = await resolve_checked(self.rt, policy, host, port)
        if denied is not None:
            fs.facts = with_addresses(facts, addresses)  # what the address check read (audit replay)
            fs.decision = denied
            return
        fs.pinned = target
        fs.intercept = allowed.intercept

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs = ensure_flow_state(flow)
        req = flow.request
        if fs.target_as_sent is None:
            fs.target_as_sent = as_sent(req)
        if flow.response is not None:
            return
        if fs.decision is not None:
            note_target(self.rt, flow, fs)  # an identity deny's record names what was asked for too
            return
        conn = self.rt.conn(flow.client_conn.id)
        tunnel = conn.tunnel_host is not None
        try:
            method = canon_method(req.method)
            raw_path, query = split_path_query(req.path)
            path = canon_path(raw_path)
        except CanonError as exc:
            fs.decision = gateway_deny(Reason.INVALID_REQUEST, f"Invalid request target: {exc}")
            return
        if tunnel:
            scheme = "https" if flow.client_conn.tls else "http"
            addresses = (conn.tunnel_target.address,) if conn.tunnel_target else ()
        else:
            scheme = req.scheme
            addresses = ()
        fs.scheme, fs.method, fs.path, fs.query = scheme, method, path, query or None
        assert fs.host is not None and fs.port is not None
        policy = self._policy(fs)
        if policy is None:
            return
        body = declared_body_size(req)
        headers = req.headers
        accept = ", ".join(headers.get_all("accept")) if "accept" in headers else None
        npm_hint = headers.get("pacote-req-type")  # npm marks its packument and tarball fetches
        overrides = [v for h in METHOD_OVERRIDE_HEADERS if h in headers for v in headers.get_all(h)]
        op = classify_overridden(method, overrides, path, query, headers.get("content-type"), accept, npm_hint)
        facts = Facts(
            operation=Operation.HTTP_REQUEST, host=fs.host, port=fs.port, scheme=scheme, method=method,
            query=query or None,
            path=path, addresses=addresses, request_bytes=request_head_size(req) + (body or 0),
            op_class=op[0] if op else None, op_protocol=op[1] if op else None,
        )
        if not (await self._decide(fs, policy, facts)).allowed:
            return
        if tunnel:
            fs.pinned = conn.tunnel_target
            return
        allowed = fs.decision
        target, denied, addresses = await resolve_checked(self.rt, policy, fs.host, fs.port)
        if denied is not None:
            fs.facts = with_addresses(facts, addresses)  # what the address check read (audit replay)
            fs.decision = denied
            return
        fs.pinned = target
        fs.decision = allowed
