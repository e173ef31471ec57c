"""Make a recorded decision take effect on the flow: answer a deny, wire up an allow.

Runs after record.py (the decision is durable, or was turned into `audit_unavailable`) and pinning.py
(an allowed destination is committed). A deny is answered with the deny contract whether or not its
record could be written; an allow gets its body stream callables, built once by compose.py from what the
earlier stages planned, its request hash and its request history.

Entering the history is also where a rule's budget is checked again by the state store's atomic
check-and-count, the authority over decide()'s snapshot (docs/architecture.md, "Enforce"). Budgets usually
did it already, with the request's prepayment in one store step (`FlowState.history_written`); Enforce does
it for a request Budgets did not write.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from mitmproxy import http

from egressgate.audit.build import build
from egressgate.audit.event import EventKind
from egressgate.gateway.shared import request_hash
from egressgate.gateway.shared.compose import (
    buffer_body,
    compose_request,
    compose_response,
    install_request,
    install_response,
)
from egressgate.gateway.shared.context import Runtime, flow_state
from egressgate.gateway.shared.counters import in_counter, out_counter, refund_prepaid, rule_budget
from egressgate.gateway.shared.deny import REQUEST_ID_HEADER, deny_response, gateway_deny
from egressgate.gateway.shared.emit import write_behind
from egressgate.gateway.shared.misuse import stream_misuse
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)

class Enforce:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def http_connect(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is None or fs.decision is None:  # record.py decides every flow; fail closed all the same
            flow.response = deny_response(gateway_deny(Reason.INVALID_REQUEST), fs.request_id if fs else "-")
            return
        if not fs.decision.allowed or fs.pinned is None:
            flow.response = deny_response(
                fs.decision if not fs.decision.allowed else gateway_deny(Reason.INVALID_REQUEST), fs.request_id
            )

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is None or fs.decision is None:
            if flow.response is None:
                flow.response = deny_response(gateway_deny(Reason.INVALID_REQUEST), fs.request_id if fs else "-")
            return
        if flow.response is not None:
            return  # answered earlier (an earlier refusal, already audited)
        decision = fs.decision
        if not decision.allowed:
            # answered before any of the body is read, whatever its size (early_answer.py)
            buffer_body(flow.request)
            flow.response = deny_response(decision, fs.request_id)
            return
        if not await self._record_history(flow, fs):
            return
        request_hash.start(flow.request, fs)
        if fs.stream_request:
            counter = out_counter(fs) if fs.meter_request else None
            install_request(flow.request, compose_request(
                fs.hasher, lambda hits: stream_misuse(self.rt, flow, fs, hits, cut=False), counter,
                fs.forbid_body))  # a phantom: the stream then aborts the upstream request and answers the
            # deny (early_answer.cut_mid_body)

    async def _record_history(self, flow: http.HTTPFlow, fs) -> bool:
        """Enter the allowed request into the sandbox's history before a byte of it goes upstream, and
        count it against its rule's budget (`budget.requests` / `budget.bytes`) in the same atomic step.
        Usually already done: budgets.py wrote both with the request's prepayment (`history_written`);
        this is for a request it did not write.

        decide() judged the rule's budget on a snapshot; concurrent requests (on this or another gateway
        process) may all have passed on the same one. The store's check-and-count is the authority: a
        request it refuses is denied `budget_exceeded` here, before anything goes upstream.
        Fail closed: a request the history does not know of would be invisible to every later
        `after_request_to` / `unless_request_to` condition and request budget, so when the state store
        cannot write it the request is refused `state_unavailable`. Either refusal returns the prepaid
        bytes (nothing went upstream) and is recorded under the request id of its allow record (a deny
        takes effect whether or not its record is written: queued and retried, never dropped)."""
        if fs.sandbox_id is None or fs.host is None:
            return True
        if fs.history_written:  # budgets.py wrote it with the prepayment, in the same store step
            return True
        allowed = fs.decision
        budget = rule_budget(self.rt, fs)
        try:
            if await self.rt.state.record_request(
                    fs.sandbox_id, fs.host, allowed.rule_id, fs.prepaid_out,
                    requests_max=budget.requests if budget is not None else None,
                    bytes_max=budget.bytes if budget is not None else None):
                return True
            refusal = gateway_deny(Reason.BUDGET_EXCEEDED, f"The budget of rule {allowed.rule_id!r} is spent "
                                   "(its budget.requests or budget.bytes); further requests under it are refused.",
                                   detail="rule_budget", rule_id=allowed.rule_id)
        except StateUnavailable as exc:
            logger.error("could not record request history for %s: %s; refusing the request", fs.sandbox_id, exc)
            refusal = gateway_deny(Reason.STATE_UNAVAILABLE, detail="request history not written",
                                   rule_id=allowed.rule_id)
        refund_prepaid(self.rt, fs)
        fs.decision = replace(refusal, capability=allowed.capability)
        write_behind(self.rt, build(
            EventKind.HTTP_REQUEST, request_id=fs.request_id, verdict=fs.decision,
            extra={"egressgate.phase": "history"}, sandbox_id=fs.sandbox_id, policy_name=fs.policy_name,
            policy_hash=fs.policy_hash, scheme=fs.scheme, host=fs.host, port=fs.port, method=fs.method,
            path=fs.path, bytes_out=fs.bytes_out,
        ))
        buffer_body(flow.request)
        flow.response = deny_response(fs.decision, fs.request_id)  # before the body (early_answer.py)
        return False

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is None or flow.response is None or fs.decision is None:
            return
        flow.response.headers[REQUEST_ID_HEADER] = fs.request_id  # joins the response to its records
        if not fs.decision.allowed:
            return
        if fs.stream_response or fs.replacement is not None:
            counter = in_counter(self.rt, fs) if fs.sandbox_id is not None else None
            install_response(flow.response, compose_response(counter, fs.scrub, fs.replacement, fs.answer_filter))
