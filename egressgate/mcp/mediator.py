"""One MCP session as the gateway mediates it, whatever carries it (streamable HTTP, SSE, stdio relay).

The transports hand every client body to `from_client` and every server message to `from_server`;
the session turns them into decisions and records, and tells the transport what to forward and what
to answer itself. The rules, stated here once:

- a client body that does not parse strictly (mcp/jsonrpc.py) is refused WHOLE and recorded: nothing of
  it is forwarded, not even its valid batch members (a partial guess is what smuggling needs);
- every `tools/call` is decided by the pure engine (policy/mcp_decide.decide_tool_call) on facts read
  from the stores (counts, pins, grants); an allowed call is counted (all budget keys at once, atomic),
  recorded (mcp_tool_call, durable) and only THEN forwarded; a denied one is answered with a JSON-RPC
  error the agent can act on and never reaches the server;
- fail closed: a store failure denies `state_unavailable`, an audit failure `audit_unavailable` (and
  gives the counted call back): a call is never forwarded unrecorded;
- the forwarded body is `dumps()` of the allowed messages (what was decided is what the server parses);
- server side: the initialize answer's serverInfo and every allowed tool's hash from tools/list are
  pinned per sandbox and server on first sight (trust on first use, set-if-absent in the state store)
  unless the policy pins them; tools/list answers are filtered to the tools a call could be allowed
  for (drifted ones removed); a tool call's answer is its outcome record; calls still unanswered when
  the session ends are recorded `no_response` (close()).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from egressgate.audit.build import new_request_id
from egressgate.audit.event import AuditEvent, AuditUnavailable
from egressgate.broker.redact import SecretSpec
from egressgate.mcp import records
from egressgate.mcp.approval import name_tool_approval
from egressgate.mcp.batch import withdraw
from egressgate.mcp.facts import FromFlow, Refused, budget_deny, facts_record, read_facts
from egressgate.mcp.jsonrpc import (
    McpMalformed,
    Message,
    deny_error,
    dumps,
    malformed_error,
    parse_body,
    reply_id,
)
from egressgate.mcp.methods import check_batch, check_client_methods
from egressgate.mcp.pending import HeldOutcome, Pending, Ticket, id_key
from egressgate.mcp.server_side import ServerSide
from egressgate.policy.mcp_decide import ToolCall, ToolDecision, decide_tool_call
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.gateway.shared.context import Runtime
    from egressgate.policy.compile import CompiledPolicy
    from egressgate.policy.mcp_compile import McpServer
    from egressgate.state.base import SandboxRecord

logger = logging.getLogger(__name__)
MAX_WAITING = 4096  # unanswered requests (calls, tracked and other requests) per session

_FAILURES = {
    Reason.STATE_UNAVAILABLE: "The gateway's state store is unavailable, so tool calls are refused; retry shortly.",
    Reason.AUDIT_UNAVAILABLE: "The gateway cannot record tool calls right now, so they are refused; retry shortly.",
    Reason.SANDBOX_REVOKED: "This sandbox was revoked; its tool calls are refused.",
    Reason.POLICY_UNAVAILABLE: "The sandbox's policy is not loaded, so tool calls are refused; ask an operator.",
    Reason.INTERNAL_ERROR: "The gateway failed to decide this tool call, so it was refused; report it to an operator.",
}


@dataclass(frozen=True, slots=True)
class ClientVerdict:
    forward: bytes | None  # what goes to the server (None: nothing)
    replies: list[dict]  # JSON-RPC answers the transport gives the client itself (denials)
    was_batch: bool = False
    refused: bool = False  # the whole body was refused (malformed)
    ticket: Ticket | None = None  # the requests forwarded: hand back to `release` when the exchange ends
    folded: bool = False  # the POST's network decision record went into a call's mcp_tool_call record

    @property
    def batch(self) -> bool:
        return self.was_batch


@dataclass(slots=True)
class _Call:
    """One decided tools/call and what is needed to record it."""

    msg: Message
    tool: str
    arguments: dict
    decision: ToolDecision
    facts: dict[str, Any] = field(default_factory=dict)
    counted: tuple[str, ...] = ()
    approval_id: str | None = None


class McpSession:
    """One per MCP session: (sandbox, server, Mcp-Session-Id) for streamable HTTP, the endpoint session
    for SSE, one process for stdio. Not shared across sessions: `server_info_now` and the latest tool
    hashes are what THIS session's client saw."""

    def __init__(self, rt: Runtime, policy: CompiledPolicy, server: McpServer, sandbox: SandboxRecord,
                 transport: str, *, secrets: tuple[SecretSpec, ...] = ()) -> None:
        self.rt = rt
        self.policy = policy  # refreshed from rt.policies per message: a reload applies to open sessions
        self.server_name = server.name
        self.sandbox_id = sandbox.id
        self.policy_name = sandbox.policy_name
        self.labels = MappingProxyType(dict(sandbox.labels))
        self.ctx = records.Context(
            sandbox_id=sandbox.id, labels=self.labels, policy_name=sandbox.policy_name,
            policy_hash=getattr(policy, "hash", None), server=server.name, transport=transport,
            scheme=server.scheme, host=server.host, port=server.port, path=server.path, secrets=secrets)
        self.server_side = ServerSide(self)
        self.calls: dict[int | str, Pending] = {}  # allowed calls waiting for their answer, by JSON-RPC id
        self._reserved: set[int | str] = set()  # ids of calls being decided right now
        # _id_key of forwarded non-call requests unanswered -> the serial of the body that reserved it
        self.outstanding: dict[int | str | bytes, int] = {}
        self._serial = 0  # of the last client body whose ids were reserved (Ticket.serial)
        self._pins_read = False
        self.closed = False
        # the version the server answered `initialize` with (server_side.py): only 2025-03-26 has batches
        self.protocol_version: str | None = None

    # -- policy ----------------------------------------------------------------------------------

    def current_policy(self) -> CompiledPolicy | None:
        holder = getattr(self.rt, "policies", None)
        policy = holder.get(self.policy_name) if holder is not None else self.policy
        if policy is not None:
            self.policy = policy
            self.ctx.policy_hash = getattr(policy, "hash", None)
        return policy

    def max_bytes(self) -> int:
        return self.policy.mcp.max_message_bytes

    # -- client -> server ------------------------------------------------------------------------

    async def from_client(self, body: bytes, flow: FromFlow | None = None,
                          protocol_header: str | None = None) -> ClientVerdict:
        """A whole client body (an HTTP POST body, a stdio line): what to forward, what to answer.
        `flow`: what the gateway flow carrying it knows (FromFlow); `folded` in the verdict says whether
        its record was folded (else the caller still owes it).

        `protocol_header`: the request's MCP-Protocol-Version header (streamable HTTP). The version the
        server answered `initialize` with wins; without one (the session began before a gateway restart)
        the header says which version this request speaks, so a 2025-03-26 session keeps its batches."""
        policy = self.current_policy()
        try:
            if policy is None:
                raise McpMalformed("policy", "no policy")  # replaced below: nothing is forwarded
            messages, was_batch = parse_body(body, max_bytes=policy.mcp.max_message_bytes)
            check_client_methods(messages)  # deny by default: `Tools/Call` is never forwarded undecided
            if was_batch:
                check_batch(self.protocol_version or protocol_header)
            self._check_ids(messages)
        except McpMalformed as exc:
            return await self._refuse_body(exc, policy is None, reply_id(body, self.max_bytes()))
        return await self._from_client(messages, was_batch, Ticket(self._serial), flow)

    async def _from_client(self, messages: list[Message], was_batch: bool,
                           ticket: Ticket | None = None, flow: FromFlow | None = None) -> ClientVerdict:
        try:
            await self.server_side.settle()  # pins and records of answers already relayed come first
            policy = self.current_policy()
            forward: list[dict] = []
            replies: list[dict] = []
            refresh = not self._pins_read
            for msg in messages:
                if msg.is_call:
                    reply = await self._call(msg, policy, flow)
                    if reply is None:
                        forward.append(msg.obj)
                        if ticket is not None:
                            ticket.calls[msg.id] = self.calls[msg.id]  # type: ignore[index]
                    else:
                        replies.append(reply)
                    continue
                if msg.kind == "request" and self.server_side.expect(msg):
                    refresh = True
                if msg.kind == "request" and ticket is not None:
                    ticket.others.append((msg.id, id_key(msg.id)))  # type: ignore[arg-type]
                forward.append(msg.obj)
            if refresh and forward:
                await self.server_side.refresh()  # the answer is filtered against what the store holds now
                self._pins_read = True
            if was_batch and replies and forward:
                replies += await withdraw(self, messages, forward, replies[0], ticket)
                forward = []
        finally:
            for msg in messages:
                if msg.is_call:
                    self._reserved.discard(msg.id)  # type: ignore[arg-type]
        body = dumps(forward if was_batch else forward[0]) if forward else None
        held = ticket if ticket is not None and (ticket.calls or ticket.others) else None
        return ClientVerdict(body, replies, was_batch, ticket=held, folded=flow is not None and flow.used)

    def _check_ids(self, messages: list[Message]) -> None:
        """A request whose id is still waiting for its answer would make two answers of one id: which one
        is the outcome of which call? Refused (the agent reuses ids only after their answers). That holds
        for ANY pending request, not only calls: a `ping` id 7 answered `{}` would otherwise be recorded
        as the outcome of a later `tools/call` id 7, whose real result then passes unrecorded. At most
        MAX_WAITING requests wait at once (bounded memory whatever the server leaves unanswered).
        Checked and reserved with no await in between, so two bodies decided at once cannot share an id."""
        for msg in messages:
            if msg.kind != "request":
                continue
            if msg.id in self.calls or msg.id in self._reserved or id_key(msg.id) in self.outstanding:
                raise McpMalformed("id_in_use", "a request reuses the id of a request still waiting for its answer")
        waiting = len(self.calls) + len(self._reserved) + len(self.outstanding)
        if waiting + sum(m.kind == "request" for m in messages) > MAX_WAITING:
            # bounded memory; never evicted instead: an answer nobody tracks would go unrecorded/unfiltered
            raise McpMalformed("too_many_pending", f"more than {MAX_WAITING} requests of this session are unanswered")
        self._serial += 1
        for msg in messages:
            if msg.is_call:
                self._reserved.add(msg.id)  # type: ignore[arg-type]
            elif msg.kind == "request":
                self.outstanding[id_key(msg.id)] = self._serial  # always forwarded

    async def _refuse_body(self, exc: McpMalformed, no_policy: bool, rid: int | str | None) -> ClientVerdict:
        if no_policy:
            reply = deny_error(rid, _FAILURES[Reason.POLICY_UNAVAILABLE], str(Reason.POLICY_UNAVAILABLE), None)
            reason, detail = Reason.POLICY_UNAVAILABLE, "policy_unavailable"
        else:
            reply = malformed_error(exc, rid)
            reason, detail = Reason.MCP_MALFORMED, exc.detail
        event = records.message_record(self.ctx, reason=str(reason), detail=detail, message=reply["error"]["message"])
        self.rt.audit.enqueue_after(event)  # refused either way: queued, never dropped
        return ClientVerdict(None, [reply], refused=True)

    async def _call(self, msg: Message, policy: CompiledPolicy | None, flow: FromFlow | None = None) -> dict | None:
        """Decide, count, approve, record one tools/call. None: forward it; else the JSON-RPC error."""
        params = msg.params
        tool, arguments = params["name"], params.get("arguments") or {}
        now = self.rt.clock()
        if policy is None:
            return await self._fail(msg, tool, arguments, Reason.POLICY_UNAVAILABLE)
        try:
            facts = await read_facts(self, policy, tool, now, flow)
        except Refused as refused:
            return await self._fail(msg, tool, arguments, refused.reason)
        try:
            decision = decide_tool_call(policy, ToolCall(self.server_name, tool, MappingProxyType(arguments)), facts,
                                        now)
        except Exception:  # a bug on odd input is still a refusal (recorded), never a forwarded call
            logger.exception("mcp: deciding a tools/call of %s/%s failed", self.sandbox_id, self.server_name)
            return await self._fail(msg, tool, arguments, Reason.INTERNAL_ERROR)
        call = _Call(msg, tool, arguments, decision, facts=facts_record(facts), approval_id=decision.approval_id)
        if decision.allowed:
            try:
                refused_key = await self.rt.state.count_calls(self.sandbox_id, decision.budget_keys)
            except StateUnavailable:
                return await self._fail(msg, tool, arguments, Reason.STATE_UNAVAILABLE)
            if refused_key is not None:  # a concurrent call took the last one after the facts were read
                call.decision = budget_deny(policy, self.server_name, tool, decision, refused_key)
            else:
                call.counted = tuple(key for key, _ in decision.budget_keys)
        elif decision.approval_kind is not None:
            call.decision, call.approval_id = await name_tool_approval(self, policy, tool, decision, now)
        fold = (flow if flow is not None and flow.record is not None and not flow.used
                and flow.record.policy_hash == self.ctx.policy_hash
                else None)  # one record states one policy's decisions (a reload in between: not folded)
        request_id = fold.record.request_id if fold is not None else new_request_id()
        event = self._record(call, request_id, policy)
        try:
            if fold is not None:
                fold.used = True  # reserved before the await: two calls of one batch never both fold it
                event = records.fold_network(event, fold.record)  # type: ignore[arg-type]
            await self.rt.audit.write(event)
        except AuditUnavailable:
            if fold is not None:
                fold.used = False  # not recorded: the caller still owes the flow's record
            if call.counted:
                with contextlib.suppress(StateUnavailable):  # the counter keeps it: over-counted, never under
                    await self.rt.state.refund_calls(self.sandbox_id, call.counted)
            return await self._fail(msg, tool, arguments, Reason.AUDIT_UNAVAILABLE)
        if call.decision.allowed:
            pending = Pending(request_id, tool, time.monotonic(), call.counted)
            if fold is not None:
                pending.held = fold.held = HeldOutcome()
            self.calls[msg.id] = pending  # type: ignore[index]
            return None
        return deny_error(msg.id, call.decision.message, str(call.decision.reason), call.decision.rule_id,
                          call.approval_id)

    def _record(self, call: _Call, request_id: str, policy: CompiledPolicy):
        d = call.decision
        return records.call_record(
            self.ctx, request_id=request_id, jsonrpc_id=call.msg.id, tool=call.tool, arguments=call.arguments,
            record_arguments=policy.mcp.record_arguments, decision=d.decision, reason=str(d.reason),
            rule_id=d.rule_id, message=d.message, detail=d.detail, failed_argument=d.failed_argument,
            approval_id=call.approval_id, facts=call.facts)

    async def _fail(self, msg: Message, tool: str, arguments: Any, reason: Reason) -> dict:
        """A deny the gateway made without the engine (a store, the audit sink, the policy failed): the
        client gets it at once; its record is queued (write_after never drops it)."""
        message = _FAILURES[reason]
        policy = self.policy
        event = records.call_record(
            self.ctx, request_id=None, jsonrpc_id=msg.id, tool=tool, arguments=arguments,
            record_arguments=bool(policy is not None and policy.mcp.record_arguments), decision="deny",
            reason=str(reason), rule_id=None, message=message)
        self.rt.audit.enqueue_after(event)
        return deny_error(msg.id, message, str(reason), None)

    # -- server -> client ------------------------------------------------------------------------

    async def from_server(self, messages: list[Message]) -> list[dict]:
        """The messages the client may see (tools/list answers filtered), effects recorded."""
        out = self.from_server_nowait(messages)
        await self.server_side.settle()
        return out

    def from_server_nowait(self, messages: list[Message]) -> list[dict]:
        """The same, synchronously (a gateway response stream cannot await): store effects (first-sight
        pins) are scheduled and awaited by the next from_client / from_server / close."""
        out = []
        for msg in messages:
            if msg.kind == "response":
                self.outstanding.pop(id_key(msg.id), None)
            if msg.kind == "response" and msg.id in self.calls:
                self._outcome(msg)
                out.append(msg.obj)
                continue
            out.append(self.server_side.handle_nowait(msg))
        return out

    async def from_server_bytes(self, body: bytes) -> bytes | None:
        """A whole server body (a JSON answer, an SSE event's data, a stdio line) in, what the client
        gets out; None when the server's message is not strict JSON-RPC (recorded; the transport drops
        it, and an answered call without a readable answer stays `no_response`)."""
        try:
            messages, was_batch = parse_body(body, max_bytes=self.max_bytes())
        except McpMalformed as exc:
            self.rt.audit.enqueue_after(records.message_record(
                self.ctx, reason=str(Reason.MCP_MALFORMED), detail="server_" + exc.detail,
                message=f"The MCP server sent a message that is not strict JSON-RPC ({exc.detail}); it was dropped."))
            return None
        out = await self.from_server(messages)
        return dumps(out if was_batch else out[0])

    def _outcome(self, msg: Message) -> None:
        pending = self.calls.pop(msg.id)  # type: ignore[arg-type]
        payload = msg.error if msg.error is not None else msg.result
        self._emit(pending, records.outcome_record(
            self.ctx, request_id=pending.request_id, tool=pending.tool, jsonrpc_id=msg.id,
            duration_ms=(time.monotonic() - pending.started) * 1000, response=msg.result, error=msg.error,
            response_bytes=len(dumps(payload))))

    def _emit(self, pending: Pending, event: AuditEvent) -> None:
        """A call's outcome record: held for the gateway flow whose record is the call's, or folded into
        that flow's outcome waiting for it (HeldOutcome.settle), else written behind."""
        out = pending.held.settle(event) if pending.held is not None else event
        if out is not None:
            self.rt.audit.enqueue_after(out)

    async def close(self) -> None:
        """The session ended: every allowed call still unanswered is recorded `no_response`."""
        if self.closed:
            return
        self.closed = True
        await self.server_side.settle()
        for jsonrpc_id, pending in list(self.calls.items()):
            if pending.held is not None:
                pending.held.open = False  # the session ends first (a gateway stop): written on its own
            self._no_response(jsonrpc_id, pending, None)
        self.calls.clear()

    def release(self, ticket: Ticket, why: str) -> None:
        """The exchange that carried `ticket`'s body ended (an HTTP error, a 202, a connection error, an
        answer that did not answer them): its requests still unanswered will never be, so their ids are
        freed (else a long session fills MAX_WAITING and every later call is refused) and each such call
        is recorded `no_response` with `why`, once. Only what THIS body reserved: an id already answered
        and reused by a later body is that body's. Never for a transport whose answers come on another
        stream (HTTP+SSE) or on an answer stream still open: the caller's rule (gateway/mcp/answer.py)."""
        for jsonrpc_id, pending in ticket.calls.items():
            if self.calls.get(jsonrpc_id) is pending:
                del self.calls[jsonrpc_id]
                self._no_response(jsonrpc_id, pending, why)
        for jsonrpc_id, key in ticket.others:
            if self.outstanding.get(key) == ticket.serial:
                del self.outstanding[key]
                self.server_side.expected.pop(jsonrpc_id, None)
        ticket.calls.clear()  # released once, whatever calls it again (response, then error)
        ticket.others.clear()

    def _no_response(self, jsonrpc_id: int | str, pending: Pending, why: str | None) -> None:
        self._emit(pending, records.outcome_record(
            self.ctx, request_id=pending.request_id, tool=pending.tool, jsonrpc_id=jsonrpc_id,
            duration_ms=(time.monotonic() - pending.started) * 1000, no_response=True, detail=why))

