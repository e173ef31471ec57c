"""audit/build.py: the one builder every audit record goes through, and the rules it states once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from egressgate.audit.build import DETAIL, build, new_request_id
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.policy.facts import Decision, Effect
from egressgate.policy.reasons import Reason

ROOT = Path(__file__).resolve().parents[2] / "egressgate"

ALLOW = Decision(Effect.ALLOW, Reason.RULE_MATCHED, rule_id="r1", capability="gh", detail="why",
                 message="ignored on an allow")
DENY = Decision(Effect.DENY, Reason.ADDRESS_FORBIDDEN, rule_id="r2", detail="private",
                message="The destination resolves to a private address.")


def test_a_deny_carries_its_message_and_detail_and_never_a_dialed_address() -> None:
    event = build(EventKind.HTTP_REQUEST, verdict=DENY, pinned_address="10.0.0.1", host="a.test")
    assert (event.decision, event.reason, event.rule_id) == ("deny", "address_forbidden", "r2")
    assert event.message == DENY.message
    assert event.extra[DETAIL] == "private"
    assert event.pinned_address is None  # a denied flow dialed nothing
    assert event.host == "a.test"


def test_an_allow_has_no_message_but_keeps_its_address_and_capability() -> None:
    event = build(EventKind.CONNECT, verdict=ALLOW, pinned_address="93.184.216.34")
    assert (event.decision, event.reason, event.capability) == ("allow", "rule_matched", "gh")
    assert event.message is None
    assert event.pinned_address == "93.184.216.34"
    assert event.extra[DETAIL] == "why"


def test_explicit_fields_win_over_the_verdict() -> None:
    """A later stage's deny may name the rule of the allow it replaced (trailers, credential misuse)."""
    event = build(EventKind.HTTP_REQUEST, verdict=DENY, rule_id="allowing-rule", capability="gh")
    assert (event.rule_id, event.capability) == ("allowing-rule", "gh")


def test_detail_key_and_an_explicit_attribute() -> None:
    dns = build(EventKind.DNS_QUERY, verdict=DENY, detail_key="egressgate.decision.detail")
    assert dns.extra == {"egressgate.decision.detail": "private"}
    given = build(EventKind.HTTP_REQUEST, verdict=DENY, extra={DETAIL: "more precise"})
    assert given.extra[DETAIL] == "more precise"


def test_time_and_request_id_defaults() -> None:
    a, b = build(EventKind.POLICY_RELOAD), build(EventKind.POLICY_RELOAD)
    assert a.request_id != b.request_id and len(a.request_id) == 32
    assert a.time_ns > 0
    fixed = build(EventKind.OUTCOME, request_id="x" * 32, time_ns=7)
    assert (fixed.request_id, fixed.time_ns) == ("x" * 32, 7)


def test_mappings_are_copied_not_aliased() -> None:
    labels, extra = {"team": "a"}, {"egressgate.mode": "transparent"}
    event = build(EventKind.ADMISSION, sandbox_labels=labels, extra=extra)
    labels["team"] = "b"
    extra["egressgate.mode"] = "changed"
    assert event.sandbox_labels == {"team": "a"}
    assert event.extra == {"egressgate.mode": "transparent"}


def test_a_misspelt_field_is_an_error() -> None:
    with pytest.raises(TypeError):
        build(EventKind.OUTCOME, hots="a.test")


def test_request_ids_are_unique() -> None:
    ids = {new_request_id() for _ in range(10000)}
    assert len(ids) == 10000


def test_every_audit_event_is_built_by_the_builder() -> None:
    """No component hand-builds an AuditEvent: the rules above hold for every record."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).as_posix() in ("audit/build.py", "audit/event.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None
            if name == "AuditEvent":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], offenders
    assert AuditEvent.__name__ == "AuditEvent"  # the name the check looks for
