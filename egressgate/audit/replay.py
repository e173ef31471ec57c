"""`egressgate audit replay`: re-decide recorded traffic under another policy.

Why it works: `policy.decide` is pure, and every decision record carries the facts it was made on
(operation, scheme, canonical host, port, method, path, qtype, the addresses the gateway would dial) and,
when the gateway records it, the exact `SandboxState` it passed (`egressgate.state.*`). Replaying that
input at the recorded time under a new policy answers "what would this policy have done last week".

What replay cannot reproduce (documented in docs/audit.md): decisions made outside the policy engine
(identity, Host/SNI consistency, self-connection, dependency failures) are skipped; without recorded state
the sandbox's past is reconstructed from the log itself (approximate); state is the *recorded* history,
not the counterfactual one (a request the new policy would deny still counts as seen). MCP tool calls
(`mcp_tool_call` records) are re-decided by audit/replay_mcp.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egressgate.audit.find import Found, iter_records
from egressgate.audit.record import (
    K_DNS_NAME,
    K_HOST,
    K_OP_CLASS,
    K_OP_PROTOCOL,
    K_OPERATION,
    Record,
    RecordFormatError,
    addresses_of,
    parse_line,
)
from egressgate.audit.replay_format import format_table, printable
from egressgate.audit.replay_mcp import OPERATION as MCP_OPERATION
from egressgate.audit.replay_mcp import McpHistory, NotReplayable, network_view, replay_tool_call
from egressgate.audit.replay_state import History, as_int, state_from, update_history
from egressgate.policy.addr import check_address
from egressgate.policy.canon import canon_host
from egressgate.policy.facts import Decision, Facts, Operation, SandboxState
from egressgate.policy.opclass import OP_CLASSES
from egressgate.policy.reasons import Effect, Reason

__all__ = ["Change", "Flip", "ReplayResult", "format_table", "printable", "replay", "replay_diff", "replay_records"]

REPLAYABLE = {op.value for op in Operation}
# Denials decided by the gateway before / outside decide(): a policy cannot change them.
NOT_POLICY_REASONS = frozenset(
    {
        "identity_unknown",
        "sandbox_revoked",
        "identity_address_mismatch",
        "invalid_request",
        "host_mismatch",
        "protocol_not_allowed",
        "trailers_not_allowed",
        "self_connection",
        "credential_unavailable",
        "credential_misuse",
        "audit_unavailable",
        "state_unavailable",
        "policy_unavailable",
        "upstream_unresolvable",
    }
)

# Every deny reason decide() itself can produce (policy/decide.py). A deny with any other reason was made
# by the gateway outside the engine (identity, consistency, transport checks such as the MCP route's
# `mcp_malformed`, dependencies, limits): a policy cannot change it, so replay skips it (NOT_POLICY_REASONS
# names the common ones for the docs; this set is the rule, so a reason added later is skipped too).
ENGINE_DENY_REASONS = frozenset({
    "host_not_allowed", "scheme_not_allowed", "method_not_allowed", "path_not_allowed", "path_ambiguous",
    "port_not_allowed", "qtype_not_allowed", "denied_by_rule", "condition_failed", "budget_exceeded",
    "approval_required", "address_forbidden", "metadata_endpoint", "package_install_denied",
})

Decide = Callable[[Any, Facts, SandboxState, float], Decision]


def outside_the_engine(reason: Any, detail: Any) -> bool:
    """A deny the engine did not make: its reason is not one decide() returns, or it is the atomic store
    check of a rule's `budget.requests` for tunnels (gateway/shared/history.py, detail `rule_budget`: concurrent
    tunnels spent what decide()'s snapshot still saw; the store's count at that moment is not recorded)."""
    return reason not in ENGINE_DENY_REASONS or (reason == "budget_exceeded" and detail == "rule_budget")


@dataclass(slots=True)
class Change:
    path: str
    line: int
    time_ns: int
    sandbox_id: str
    operation: str
    target: str
    old_decision: str
    old_rule: str | None
    old_reason: str | None
    new_decision: str
    new_rule: str | None
    new_reason: str
    request_id: str | None = None

    @property
    def direction(self) -> str:
        return f"{self.old_decision}->{self.new_decision}"

    def to_json(self) -> dict[str, Any]:
        """Plain data for the console's JSON API (every string is attacker-influenced: data, never HTML)."""
        return {
            "file": self.path, "line": self.line, "time_ns": self.time_ns, "sandbox": self.sandbox_id,
            "request_id": self.request_id, "operation": self.operation, "target": self.target,
            "direction": self.direction,
            "old": {"decision": self.old_decision, "rule": self.old_rule, "reason": self.old_reason},
            "new": {"decision": self.new_decision, "rule": self.new_rule, "reason": self.new_reason},
        }


# A decision that changes under a candidate policy (what `replay_diff` returns).
Flip = Change


@dataclass(slots=True)
class ReplayResult:
    replayed: int = 0
    unchanged: int = 0
    changes: list[Change] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    approximated_state: int = 0  # records replayed with state reconstructed from the log
    # approval id -> replayed decisions it allowed (reason approval_granted): allowed by an operator's
    # approval (recorded in egressgate.state.approvals), not by any rule of the replayed policy
    by_approval: dict[str, int] = field(default_factory=dict)
    arguments_unchecked: int = 0  # MCP tool calls allowed without their arguments (not recorded)
    truncated: bool = False  # stopped at `limit` changes

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def facts_from(attrs: dict[str, Any]) -> Facts:
    op = Operation(attrs[K_OPERATION])
    host = attrs.get(K_HOST) or attrs.get(K_DNS_NAME)
    if not isinstance(host, str):
        raise ValueError("record has no host")
    # The engine is only ever given canonical hosts (policy.canon) and origin-form paths; a record holding
    # anything else was not written by the gateway for a decision (a forged or corrupted line) and cannot
    # be re-decided: it is skipped, never a traceback in the auditor's tool (CanonError is a ValueError).
    if canon_host(host) != host:
        raise ValueError("record host is not canonical")
    path = attrs.get("url.path")
    if isinstance(path, str) and not path.startswith("/"):
        raise ValueError("record path is not in origin form")
    port = attrs.get("server.port")
    op_class, protocol = attrs.get(K_OP_CLASS), attrs.get(K_OP_PROTOCOL)
    scheme = attrs.get("url.scheme") if isinstance(attrs.get("url.scheme"), str) else None
    if op is Operation.CONNECT and scheme == "tcp":
        # a raw-TCP decision (bytes neither TLS nor HTTP inside a CONNECT tunnel, or on the transparent
        # listener), recorded under its connection's kind: decide() judged it as a request of scheme tcp
        # (layers/next_layer.py, shared/transparent_decide.py), never as the tunnel's CONNECT
        op = Operation.HTTP_REQUEST
    return Facts(
        operation=op,
        host=host,
        port=port if isinstance(port, int) else None,
        scheme=scheme,
        method=attrs.get("http.request.method")
        if isinstance(attrs.get("http.request.method"), str)
        else None,
        path=path if isinstance(path, str) else None,
        query=attrs.get("url.query") if isinstance(attrs.get("url.query"), str) else None,
        addresses=addresses_of(attrs),
        qtype=attrs.get("egressgate.dns.qtype")
        if isinstance(attrs.get("egressgate.dns.qtype"), str)
        else None,
        request_bytes=as_int(attrs.get("egressgate.facts.request_bytes")),
        op_class=op_class if op_class in OP_CLASSES else None,
        op_protocol=protocol if isinstance(protocol, str) and op_class in OP_CLASSES else None,
    )


def load_policy_set(path: str | Path) -> tuple[dict[str, Any], Any | None]:
    """(policies by name, the single policy when `path` is a file: it then applies to every record)."""
    from egressgate.policy.loader import load_policies, load_policy

    p = Path(path)
    if p.is_dir():
        return load_policies(p), None
    single = load_policy(p)
    return {single.name: single}, single


def replay(
    paths: Sequence[str | Path], policy_path: str | Path, decide: Decide | None = None
) -> ReplayResult:
    policies, single = load_policy_set(policy_path)
    return replay_records(iter_records(paths), policies, single, decide)


def replay_records(
    records: Iterable[Found],
    policies: Mapping[str, Any],
    single: Any | None,
    decide: Decide | None = None,
    *,
    sandbox: str | None = None,
    since_ns: int | None = None,
    limit: int | None = None,
) -> ReplayResult:
    """Re-decide `records` (in log order) under `single` (every record) or `policies` (by the record's
    policy name). The one replay path: the CLI, `replay_diff` and `policy learn` all come through here.

    `sandbox` keeps only that sandbox's records (the others never enter the result, nor its history).
    Records before `since_ns` still build the sandbox's history (its state at later records) but are
    not re-decided. `limit` stops after that many changes (`truncated` says so)."""
    if decide is None:
        from egressgate.policy.decide import decide as decide_fn

        decide = decide_fn
    result = ReplayResult()
    history: dict[str, History] = {}
    mcp_history = McpHistory()
    for found in records:
        attrs = found.record.attributes
        op = attrs.get(K_OPERATION)
        sandbox_id = str(attrs.get("egressgate.sandbox.id", ""))
        if sandbox is not None and sandbox_id != sandbox:
            continue
        time_s = found.record.time_ns / 1e9
        hist = history.setdefault(sandbox_id, History())
        if op in REPLAYABLE and (since_ns is None or found.record.time_ns >= since_ns):
            _replay_one(found, attrs, sandbox_id, hist, time_s, policies, single, decide, result)
            if limit is not None and len(result.changes) >= limit:
                result.truncated = True
                break
        elif op == MCP_OPERATION and (since_ns is None or found.record.time_ns >= since_ns):
            _replay_tool_call(found, attrs, sandbox_id, mcp_history, time_s, policies, single, result)
            network = network_view(attrs)  # the POST that carried the call, folded into its record
            if network is not None:
                _replay_one(found, network, sandbox_id, hist, time_s, policies, single, decide, result)
            if limit is not None and len(result.changes) >= limit:
                result.truncated = True
                break
        update_history(hist, network_view(attrs) or attrs if op == MCP_OPERATION else attrs, time_s)
        mcp_history.update(sandbox_id, attrs)
    return result


RecordLike = Found | Record | bytes | str | Mapping[str, Any]


def as_found(records: Iterable[RecordLike], source: str = "<records>") -> Iterator[Found]:
    """Records from any caller (files, the index, the console) as `Found`: a raw JSONL line or its parsed
    OTLP/JSON document (`AuditIndex.record`) is parsed (an unparseable one is skipped, as `iter_records`
    does: `audit verify` reports those); a bare `Record` or line gets its position in the sequence as its
    line number (build `Found(file, line, raw, record)` to keep the file's own positions)."""
    for number, item in enumerate(records, start=1):
        if isinstance(item, Found):
            yield item
        elif isinstance(item, Record):
            yield Found(source, number, b"", item)
        else:
            if isinstance(item, Mapping):
                item = json.dumps(item)
            raw = item.encode() if isinstance(item, str) else item
            try:
                yield Found(source, number, raw, parse_line(raw))
            except RecordFormatError:
                continue


def replay_diff(
    records: Iterable[RecordLike],
    candidate_policy_set: Any,
    sandbox: str | None = None,
    since_ns: int | None = None,
    limit: int | None = None,
) -> list[Flip]:
    """The decisions of `records` that `candidate_policy_set` would change (pure: no file, no clock).

    `candidate_policy_set` is one compiled policy (applies to every record, like `audit replay --policy
    FILE`) or a mapping name -> compiled policy (matched by the record's policy name, like a directory)."""
    if isinstance(candidate_policy_set, Mapping):
        policies, single = candidate_policy_set, None
    else:
        policies, single = {candidate_policy_set.name: candidate_policy_set}, candidate_policy_set
    return replay_records(
        as_found(records), policies, single, sandbox=sandbox, since_ns=since_ns, limit=limit
    ).changes


def _replay_one(
    found, attrs, sandbox_id, hist, time_s, policies, single, decide, result: ReplayResult
) -> None:
    old = attrs.get("egressgate.decision")
    reason = attrs.get("egressgate.reason")
    if old not in ("allow", "deny"):
        result.skip("no recorded decision")
        return
    if old == "deny" and (reason in NOT_POLICY_REASONS or outside_the_engine(reason, attrs.get("egressgate.detail"))):
        result.skip(f"decided outside the policy ({reason})")
        return
    policy = single or policies.get(str(attrs.get("egressgate.policy.name")))
    if policy is None:
        result.skip(f"no policy named {attrs.get('egressgate.policy.name')!r}")
        return
    answer_filter = attrs.get(K_OPERATION) == "dns_query" and attrs.get("egressgate.dns.stage") == "answer_filter"
    try:
        facts = facts_from(attrs)
    except (ValueError, KeyError):
        result.skip("record lacks the facts to re-decide")
        return
    if answer_filter and old == "deny" and not facts.addresses:
        result.skip(f"decided outside the policy ({reason}: the DNS answer's shape)")
        return
    # the replayed policy is the recording one: its history patterns are the record's seen_scope
    hint = policy.history_patterns if attrs.get("egressgate.policy.hash") == getattr(policy, "hash", None) else None
    state, exact = state_from(attrs, sandbox_id, hist, time_s, hint)
    if not exact:
        result.approximated_state += 1
    new = budget_stage(policy, attrs, decide(policy, facts, state, time_s))
    if answer_filter:
        new = answer_filter_stage(policy, facts, new)
    target = attrs.get("egressgate.target.canonical") or facts.host
    _tally(result, found, attrs, sandbox_id, str(target), str(new.effect), new.rule_id, new.approval_id, new.reason)


def budget_stage(policy: Any, attrs: dict[str, Any], new: Decision) -> Decision:
    """The gateway's byte-budget check after decide() (gateway/pipeline/budgets.py): a request whose known size did
    not fit in what was left of `outbound_bytes_max` was refused there, and its record carries what that
    check read (`egressgate.budget.needed`, `egressgate.budget.spent`). Re-applied under the replayed
    policy's budget, so the same policy refuses it again and a larger budget allows it. Allowed records
    carry no such figures: a smaller replayed budget is applied to them by decide() alone (bytes already
    spent), not to the size of the request itself."""
    needed, spent = attrs.get("egressgate.budget.needed"), attrs.get("egressgate.budget.spent")
    limit = getattr(policy, "outbound_bytes_max", None)
    if (new.effect != Effect.ALLOW or limit is None or not isinstance(needed, int) or not isinstance(spent, int)
            or spent + needed <= limit):
        return new
    return Decision(effect=Effect.DENY, reason=Reason.BUDGET_EXCEEDED, detail="outbound_bytes_max")


def answer_filter_stage(policy: Any, facts: Facts, new: Decision) -> Decision:
    """The resolver's answer filter after decide() (dns/filter.py): a DNS answer whose every address the
    address check removed is refused `address_forbidden`. Its record carries those addresses
    (`egressgate.facts.addresses`); under the replayed policy's `allow_private` the answer is emptied again
    when none of them is allowed."""
    if new.effect != Effect.ALLOW or not facts.addresses:
        return new
    if all(check_address(a, policy.allow_private) is not None for a in facts.addresses):
        return Decision(effect=Effect.DENY, reason=Reason.ADDRESS_FORBIDDEN, detail="every address in the answer "
                        "was removed")
    return new


def _tally(result: ReplayResult, found, attrs, sandbox_id: str, target: str, new_decision: str,
           new_rule: str | None, new_approval: str | None, new_reason: Any) -> None:
    """Count one re-decided record; a changed effect becomes a Change (old and new rule / reason)."""
    result.replayed += 1
    if new_approval is not None and new_decision == "allow":
        result.by_approval[new_approval] = result.by_approval.get(new_approval, 0) + 1
    old, reason = attrs.get("egressgate.decision"), attrs.get("egressgate.reason")
    if new_decision == old:
        result.unchanged += 1
        return
    request_id = attrs.get("egressgate.request.id")
    result.changes.append(Change(
        found.path, found.line, found.record.time_ns, sandbox_id, str(attrs.get(K_OPERATION)), target, str(old),
        _rule_or_approval(attrs.get("egressgate.rule"), attrs.get("egressgate.approval.id"), reason),
        str(reason) if reason is not None else None, new_decision,
        _rule_or_approval(new_rule, new_approval, str(new_reason)), str(new_reason),
        request_id if isinstance(request_id, str) else None))


def _rule_or_approval(rule: Any, approval_id: Any, reason: Any) -> str | None:
    """What allowed (or was asked of) a decision: its rule, or `approval <id>` when an operator's approval
    allowed it (approval_granted) or was asked for (approval_required)."""
    if isinstance(rule, str):
        return rule
    if reason in ("approval_granted", "approval_required") and isinstance(approval_id, str):
        return f"approval {approval_id}"
    return None


def _replay_tool_call(found, attrs, sandbox_id, mcp_history, time_s, policies, single, result) -> None:
    """An `mcp_tool_call` record (audit/replay_mcp.py says what is and is not re-decided)."""
    policy = single or policies.get(str(attrs.get("egressgate.policy.name")))
    if policy is None:
        result.skip(f"no policy named {attrs.get('egressgate.policy.name')!r}")
        return
    try:
        done = replay_tool_call(policy, attrs, sandbox_id, mcp_history, time_s)
    except NotReplayable as exc:
        result.skip(str(exc))
        return
    result.approximated_state += not done.exact_state
    result.arguments_unchecked += not done.arguments_checked
    new = done.decision
    _tally(result, found, attrs, sandbox_id, done.target, new.decision, new.rule_id, new.approval_id, new.reason)
