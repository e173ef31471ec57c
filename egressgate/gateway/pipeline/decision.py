"""Build canonical facts, call the pure decision engine, and stage the pinned destination.

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

from egressgate.gateway.shared.approval_gate import settle, spend
from egressgate.gateway.shared.context import FlowState, Runtime, ensure_flow_state
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.destination import resolve_checked, with_addresses
from egressgate.gateway.shared.sizes import declared_body_size, request_head_size
from egressgate.gateway.shared.target import as_sent, note_target
from egressgate.policy.canon import CanonError, canon_method, canon_path, split_host_port, split_path_query
from egressgate.policy.decide import decide
from egressgate.policy.facts import Facts, Operation, SandboxState
from egressgate.policy.opclass import METHOD_OVERRIDE_HEADERS, PUBLISH, classify_overridden, publish_commit
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)


class DecisionAddon:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def _snapshot(self, fs: FlowState, policy) -> SandboxState | None:
        """Only what `policy` can read (its history patterns, its budgeted rules: a Redis backend then
        skips the rest of a long history); relevant_state in _decide reduces any backend's answer to
        exactly that, so the decision and its audit record are the same as with the full snapshot."""
        try:
            assert fs.sandbox_id is not None
            return self.rt.ledger.spent_view(await self.rt.state.snapshot(  # leases held here: unspent
                fs.sandbox_id, history=policy.history_patterns, rules=policy.budgeted_rules))
        except (StateUnavailable, KeyError):
            fs.decision = gateway_deny(Reason.STATE_UNAVAILABLE)
            return None

    async def _decide(self, fs: FlowState, policy, facts: Facts, snapshot: SandboxState):
        """The pure decision, plus exactly the inputs it saw for the audit record (and replay); an
        `approval_required` deny gets its approval (approval_gate.py)."""
        snapshot = policy.relevant_state(snapshot)  # same decision; what the audit record carries
        now = self.rt.clock()
        decision = decide(policy, facts, snapshot, now)
        if decision.reason is Reason.APPROVAL_REQUIRED:
            assert fs.policy_name is not None
            decision, snapshot = await settle(self.rt, policy, fs.policy_name, facts, snapshot, decision, now)
        if (decision.reason is Reason.APPROVAL_GRANTED and decision.approval_kind == PUBLISH
                and publish_commit(facts.method, facts.op_protocol, facts.path)):
            assert fs.policy_name is not None  # a publish approval passes one publish: its commit spends it
            decision = await spend(self.rt, policy, fs.policy_name, facts, snapshot, decision, now)
        fs.decision = decision
        fs.facts = facts
        fs.state = snapshot
        return fs.decision

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
        snapshot = await self._snapshot(fs, policy) if policy is not None else None
        if policy is None or snapshot is None:
            return
        facts = Facts(operation=Operation.CONNECT, host=host, port=port)
        if not (await self._decide(fs, policy, facts, snapshot)).allowed:
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
        snapshot = await self._snapshot(fs, policy) if policy is not None else None
        if policy is None or snapshot is None:
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
        if not (await self._decide(fs, policy, facts, snapshot)).allowed:
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
