"""A recorded session for `policy learn`: every decision is made by the real engine (decide) under the
base policy, with the facts and sandbox state the gateway records, and written by the real audit sink
(FileSink, hash chain and signed checkpoints) -- the same file `egressgate run` would produce for that
traffic. Records the gateway makes outside the engine (revoked, unknown identity, malformed) and forged
records (what a tampered or hostile file could hold) are written explicitly."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.filesink import FileSink
from egressgate.audit.record import Record, record_from_event
from egressgate.audit.signer import LocalEd25519Signer
from egressgate.policy.decide import decide
from egressgate.policy.facts import Facts, Operation, RuleUsage, SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.target import parse_target

T0 = 1_795_000_000.0
_KIND = {Operation.DNS_QUERY: EventKind.DNS_QUERY, Operation.CONNECT: EventKind.CONNECT}


@dataclass
class _Sbx:
    labels: dict[str, str]
    seen: set[str] = field(default_factory=set)
    usage: dict[str, RuleUsage] = field(default_factory=dict)
    dns: int = 0


class Session:
    def __init__(self, policy_text: str) -> None:
        self.policy_text = policy_text
        self.policy = parse_policy(policy_text, "base.yaml")
        self.events: list[AuditEvent] = []
        self.sandboxes: dict[str, _Sbx] = {}
        self.clock = 0

    def _now(self, at: float | None) -> float:
        self.clock += 1
        return T0 + (at if at is not None else self.clock)

    def admit(self, sid: str, labels: dict[str, str] | None = None) -> None:
        self.sandboxes[sid] = _Sbx(dict(labels or {}))
        self.events.append(AuditEvent(EventKind.ADMISSION, int(self._now(None) * 1e9), f"adm-{sid}", sandbox_id=sid,
                                      sandbox_labels=dict(labels or {}), decision="allow",
                                      policy_name=self.policy.name))

    def decide(self, sid: str, facts: Facts, at: float | None = None) -> AuditEvent:
        """Decide and record like the gateway; returns the decision event."""
        sbx = self.sandboxes[sid]
        now = self._now(at)
        state = SandboxState(sid, T0, sbx.labels, dns_queries=sbx.dns, seen_hosts=frozenset(sbx.seen),
                             rule_usage=dict(sbx.usage))
        d = decide(self.policy, facts, state, now)
        event = AuditEvent(
            _KIND.get(facts.operation, EventKind.HTTP_REQUEST), int(now * 1e9), f"r{len(self.events)}",
            sandbox_id=sid, sandbox_labels=sbx.labels, decision=str(d.effect), reason=str(d.reason),
            rule_id=d.rule_id, policy_name=self.policy.name, policy_hash=self.policy.hash, scheme=facts.scheme,
            host=facts.host, port=facts.port, method=facts.method, path=facts.path, qtype=facts.qtype,
            facts=facts, state=self.policy.relevant_state(state),
        )
        self.events.append(event)
        if facts.operation is Operation.DNS_QUERY:
            sbx.dns += 1
        elif d.allowed and facts.operation is Operation.HTTP_REQUEST:
            sbx.seen.add(facts.host)
            u = sbx.usage.get(d.rule_id or "", RuleUsage())
            sbx.usage[d.rule_id or ""] = RuleUsage(u.requests + 1, u.bytes)
        return event

    def request(self, sid: str, text: str, addresses: tuple[str, ...] = (), at: float | None = None) -> AuditEvent:
        return self.decide(sid, parse_target(text, tuple(ipaddress.ip_address(a) for a in addresses)), at)

    def connect(self, sid: str, host: str, port: int = 443) -> AuditEvent:
        return self.decide(sid, Facts(Operation.CONNECT, host, port))

    def dns(self, sid: str, name: str) -> AuditEvent:
        return self.decide(sid, Facts(Operation.DNS_QUERY, name, qtype="A", scheme="dns"))

    def recorded(self, sid: str | None, reason: str, kind: EventKind = EventKind.HTTP_REQUEST, **fields) -> AuditEvent:
        """A decision the gateway makes outside the engine, or a forged record: written as given."""
        labels = self.sandboxes[sid].labels if sid in self.sandboxes else {}
        event = AuditEvent(kind, int(self._now(None) * 1e9), f"r{len(self.events)}", sandbox_id=sid,
                           sandbox_labels=labels, decision="deny", reason=reason, policy_name=self.policy.name,
                           **fields)
        self.events.append(event)
        return event

    def records(self) -> list[Record]:
        return [record_from_event(e) for e in self.events]

    async def write(self, path: Path, signer: LocalEd25519Signer) -> Path:
        sink = await FileSink(path, signer).start()
        try:
            for e in self.events:
                await sink.write(e)
        finally:
            await sink.close()
        return path


@pytest.fixture
def signer(tmp_path) -> LocalEd25519Signer:
    return LocalEd25519Signer.load_or_create(tmp_path / "keys" / "audit-signing.key")


def lines(session: Session) -> list[bytes]:
    """The session as audit-file lines, through the real encoder (what `learn` reads from a file)."""
    from egressgate.audit.record import dumps, to_otlp

    return [dumps(to_otlp(r)) for r in session.records()]


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory):
    """The loopback gateway world (tests/support/gwworld.py), for test_learn_gateway.py."""
    from tests.support.gwworld import open_world

    with open_world(tmp_path_factory.mktemp("gwworld")) as w:
        yield w
