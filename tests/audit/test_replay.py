"""replay finds exactly the decisions that change between two policies over a recorded session."""

from __future__ import annotations

import ipaddress
import textwrap

import pytest
from click.testing import CliRunner

from egressgate.audit.cli import audit
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.replay import format_table, replay
from egressgate.policy.decide import decide
from egressgate.policy.facts import Facts, Operation, RuleUsage, SandboxState
from egressgate.policy.loader import load_policy

OLD = """
sandbox: {name: invoice-analysis}
network:
  allow_private: [198.18.0.0/15]
  dns: {allow: [api.openai.com, pypi.org, files.pythonhosted.org]}
  https:
    allow:
      - {id: openai, host: api.openai.com, methods: [POST], paths: [/v1/responses]}
      - {id: pyfiles, host: files.pythonhosted.org, methods: [GET]}
      - {id: upload, host: uploads.example.com, methods: [PUT], when: {within_seconds: 60}}
"""
NEW = """
sandbox: {name: invoice-analysis}
network:
  allow_private: [198.18.0.0/15]
  dns: {allow: [api.openai.com, pypi.org]}
  https:
    allow:
      - {id: openai, host: api.openai.com, methods: [POST], paths: [/v1/responses]}
      - {id: pypi-simple, host: pypi.org, methods: [GET], paths: ["/simple/**"]}
      - {id: upload, host: uploads.example.com, methods: [PUT], when: {within_seconds: 30}}
      - {id: openai-models, host: api.openai.com, methods: [GET], paths: [/v1/models], budget: {requests: 1}}
"""
T0 = 1_795_000_000.0
ADDR = (ipaddress.ip_address("198.18.0.20"),)

# (id, offset seconds, facts, expected change under NEW or None)
SESSION = [
    ("dns-openai", 1, Facts(Operation.DNS_QUERY, "api.openai.com", qtype="A", scheme="dns"), None),
    ("dns-pyfiles", 2, Facts(Operation.DNS_QUERY, "files.pythonhosted.org", qtype="A", scheme="dns"), "allow->deny"),
    ("conn-openai", 3, Facts(Operation.CONNECT, "api.openai.com", 443, addresses=ADDR), None),
    ("conn-pyfiles", 4, Facts(Operation.CONNECT, "files.pythonhosted.org", 443, addresses=ADDR), "allow->deny"),
    ("conn-pypi", 5, Facts(Operation.CONNECT, "pypi.org", 443, addresses=ADDR), "deny->allow"),
    (
        "post-responses",
        6,
        Facts(Operation.HTTP_REQUEST, "api.openai.com", 443, "https", "POST", "/v1/responses", ADDR, request_bytes=300),
        None,
    ),
    (
        "get-wheel",
        7,
        Facts(Operation.HTTP_REQUEST, "files.pythonhosted.org", 443, "https", "GET", "/packages/a.whl", ADDR),
        "allow->deny",
    ),
    (
        "get-simple",
        8,
        Facts(Operation.HTTP_REQUEST, "pypi.org", 443, "https", "GET", "/simple/requests/", ADDR),
        "deny->allow",
    ),
    ("put-early", 10, Facts(Operation.HTTP_REQUEST, "uploads.example.com", 443, "https", "PUT", "/x", ADDR), None),
    (
        "put-late",
        45,
        Facts(Operation.HTTP_REQUEST, "uploads.example.com", 443, "https", "PUT", "/x", ADDR),
        "allow->deny",
    ),
    (
        "get-models",
        50,
        Facts(Operation.HTTP_REQUEST, "api.openai.com", 443, "https", "GET", "/v1/models", ADDR),
        "deny->allow",
    ),
    (
        "delete-models",
        51,
        Facts(Operation.HTTP_REQUEST, "api.openai.com", 443, "https", "DELETE", "/v1/models", ADDR),
        None,
    ),
]


@pytest.fixture
def policies(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    (tmp_path / "old" / "p.yaml").write_text(textwrap.dedent(OLD))
    (tmp_path / "new" / "p.yaml").write_text(textwrap.dedent(NEW))
    return tmp_path / "old" / "p.yaml", tmp_path / "new" / "p.yaml"


async def record_session(sink, old_path, with_state: bool | str) -> None:
    """What the gateway does: decide under the live policy, record facts + state, update state."""
    policy = load_policy(old_path)
    labels = {"team": "finance"}
    await sink.write(
        AuditEvent(
            EventKind.ADMISSION,
            int(T0 * 1e9),
            "adm",
            sandbox_id="sbx-1",
            sandbox_labels=labels,
            decision="allow",
            policy_name=policy.name,
        )
    )
    seen: set[str] = set()
    usage: dict[str, RuleUsage] = {}
    dns_q = 0
    for rid, offset, facts, _ in SESSION:
        state = SandboxState("sbx-1", T0, labels, dns_queries=dns_q, seen_hosts=frozenset(seen), rule_usage=usage)
        if with_state == "relevant":  # what the gateway records: only what the live policy can read
            state = policy.relevant_state(state)
        now = T0 + offset
        d = decide(policy, facts, state, now)
        kind = {Operation.DNS_QUERY: EventKind.DNS_QUERY, Operation.CONNECT: EventKind.CONNECT}.get(
            facts.operation, EventKind.HTTP_REQUEST
        )
        await sink.write(
            AuditEvent(
                kind,
                int(now * 1e9),
                rid,
                sandbox_id="sbx-1",
                sandbox_labels=labels,
                decision=str(d.effect),
                reason=str(d.reason),
                rule_id=d.rule_id,
                policy_name=policy.name,
                policy_hash=policy.hash,
                scheme=facts.scheme,
                host=facts.host,
                port=facts.port,
                method=facts.method,
                path=facts.path,
                qtype=facts.qtype,
                pinned_address=str(facts.addresses[0]) if facts.addresses else None,
                facts=facts if with_state else None,
                state=state if with_state else None,
            )
        )
        if facts.operation is Operation.DNS_QUERY:
            dns_q += 1
        if d.allowed and facts.operation is Operation.HTTP_REQUEST:
            seen.add(facts.host)
            u = usage.get(d.rule_id, RuleUsage())
            usage = {**usage, d.rule_id: RuleUsage(u.requests + 1, u.bytes + facts.request_bytes)}
            await sink.write(
                AuditEvent(
                    EventKind.OUTCOME,
                    int(now * 1e9) + 1,
                    rid,
                    sandbox_id="sbx-1",
                    status=200,
                    bytes_out=facts.request_bytes,
                    bytes_in=10,
                )
            )
    # decided outside the policy engine: never "changed" by a policy
    await sink.write(
        AuditEvent(
            EventKind.HTTP_REQUEST,
            int((T0 + 60) * 1e9),
            "unknown-id",
            decision="deny",
            reason="identity_unknown",
            host="pypi.org",
            port=443,
            scheme="https",
            method="GET",
            path="/simple/",
        )
    )


@pytest.mark.parametrize("with_state", [True, "relevant", False])
async def test_replay_finds_exactly_the_changed_decisions(make_sink, policies, with_state):
    old_path, new_path = policies
    sink = await make_sink()
    await record_session(sink, old_path, with_state)
    await sink.close()

    same = replay([sink.path], old_path)
    assert same.changes == [] and same.replayed == len(SESSION)

    result = replay([sink.path], new_path)
    got = {}
    for c in result.changes:
        rid = next(r for r, off, *_ in SESSION if int((T0 + off) * 1e9) == c.time_ns)
        got[rid] = c.direction
    expected = {rid: change for rid, _, _, change in SESSION if change}
    assert got == expected
    assert result.unchanged == len(SESSION) - len(expected)
    assert result.skipped == {"decided outside the policy (identity_unknown)": 1}
    assert result.approximated_state == (0 if with_state else len(SESSION))
    late = next(c for c in result.changes if c.new_reason == "condition_failed")
    assert (late.old_rule, late.new_rule) == ("upload", "upload")
    simple = next(c for c in result.changes if c.target == "https://pypi.org:443/simple/requests/")
    assert (simple.old_reason, simple.new_rule, simple.new_reason) == (
        "host_not_allowed",
        "pypi-simple",
        "rule_matched",
    )
    table = format_table(result)
    assert "allow->deny" in table and "deny->allow" in table and "pypi-simple / rule_matched" in table


async def test_replay_cli_exit_codes_and_directory(make_sink, policies):
    old_path, new_path = policies
    sink = await make_sink()
    await record_session(sink, old_path, True)
    await sink.close()
    r = CliRunner().invoke(audit, ["replay", str(sink.path), "--policy", str(old_path)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("0 changed")
    r = CliRunner().invoke(audit, ["replay", str(sink.path), "--policy", str(new_path.parent)])
    assert r.exit_code == 1
    assert len([ln for ln in r.output.splitlines() if "->" in ln]) == 7
    bad = new_path.parent / "broken.yaml"
    bad.write_text("sandbox: {name: x}\nnetwork: {https: {allow: [{hots: a}]}}\n")
    r = CliRunner().invoke(audit, ["replay", str(sink.path), "--policy", str(new_path.parent)])
    assert r.exit_code == 2 and "policy does not load" in r.output


async def test_replay_table_neutralizes_hostile_targets(make_sink, policies):
    old_path, _ = policies
    sink = await make_sink()
    await sink.write(
        AuditEvent(
            EventKind.HTTP_REQUEST,
            int(T0 * 1e9),
            "evil",
            sandbox_id="s",
            decision="allow",
            rule_id="x",
            policy_name="invoice-analysis",
            scheme="https",
            host="evil.example",
            port=443,
            method="GET",
            path="/\x1b[2J\rOK",
        )
    )
    await sink.close()
    result = replay([sink.path], old_path)
    assert len(result.changes) == 1
    table = format_table(result)
    assert "\x1b" not in table and "\r" not in table and "\\x1b[2J\\rOK" in table


async def test_replay_reads_history_the_recording_policy_did_not_record(make_sink, tmp_path):
    """The gateway records only the state its live policy can read (relevant_state). A replayed policy that
    budgets a rule or asks about a host the live one did not must still see the sandbox's real past: replay
    merges the log's history under the recorded values."""
    live = tmp_path / "live.yaml"
    live.write_text("sandbox: {name: p}\nnetwork:\n  allow_private: [198.18.0.0/15]\n  https:\n    allow:\n"
                    "      - {id: wheels, host: files.pythonhosted.org, methods: [GET]}\n")
    budgeted = tmp_path / "budgeted.yaml"
    budgeted.write_text("sandbox: {name: p}\nnetwork:\n  allow_private: [198.18.0.0/15]\n  https:\n    allow:\n"
                        "      - {id: wheels, host: files.pythonhosted.org, methods: [GET], budget: {requests: 1}}\n")
    policy = load_policy(live)
    sink = await make_sink()
    seen: set[str] = set()
    usage: dict[str, RuleUsage] = {}
    for i in range(2):
        facts = Facts(Operation.HTTP_REQUEST, "files.pythonhosted.org", 443, "https", "GET", f"/{i}.whl", ADDR)
        full = SandboxState("sbx-2", T0, {}, seen_hosts=frozenset(seen), rule_usage=usage)
        recorded = policy.relevant_state(full)
        assert recorded.rule_usage == {} and recorded.seen_hosts == frozenset()  # nothing the live policy reads
        now = T0 + i
        d = decide(policy, facts, recorded, now)
        assert d.allowed
        await sink.write(AuditEvent(EventKind.HTTP_REQUEST, int(now * 1e9), f"r{i}", sandbox_id="sbx-2",
                                    decision="allow", reason=str(d.reason), rule_id=d.rule_id, policy_name="p",
                                    policy_hash=policy.hash, scheme="https", host=facts.host, port=443,
                                    method="GET", path=facts.path, facts=facts, state=recorded))
        seen.add(facts.host)
        usage = {"wheels": RuleUsage(i + 1, 0)}
    await sink.close()
    result = replay([sink.path], budgeted)
    assert [(c.direction, c.new_reason) for c in result.changes] == [("allow->deny", "budget_exceeded")]
    assert result.unchanged == 1


@pytest.mark.parametrize("relay", [{"egressgate.tls": "passthrough", "egressgate.intercept": False},
                                   {"egressgate.intercept": False}, {}])
async def test_replay_history_includes_relayed_tunnels(make_sink, tmp_path, relay):
    """A tunnel the gateway relays unread (tls: passthrough, a tcp rule) is a request to its host and
    enters the sandbox's history; replay's reconstruction must count it, or a replayed
    `unless_request_to` would not see it. Control ({}): an intercepted CONNECT is not a request (its
    requests are), so the same replay finds nothing to change."""
    live = tmp_path / "live.yaml"
    live.write_text("sandbox: {name: p}\nnetwork:\n  allow_private: [198.18.0.0/15]\n  https:\n    allow:\n"
                    "      - {id: secrets, host: secrets.example.com, tls: passthrough}\n"
                    "      - {id: up, host: uploads.example.com}\n")
    strict = tmp_path / "strict.yaml"
    strict.write_text("sandbox: {name: p}\nnetwork:\n  allow_private: [198.18.0.0/15]\n  https:\n    allow:\n"
                      "      - {id: secrets, host: secrets.example.com, tls: passthrough}\n"
                      "      - {id: up, host: uploads.example.com, when: {unless_request_to: [secrets.example.com]}}\n")
    policy = load_policy(live)
    sink = await make_sink()
    state = policy.relevant_state(SandboxState("sbx-3", T0, {}, seen_hosts=frozenset({"secrets.example.com"})))
    connect = Facts(Operation.CONNECT, "secrets.example.com", 443, addresses=ADDR)
    await sink.write(AuditEvent(EventKind.CONNECT, int(T0 * 1e9), "c1", sandbox_id="sbx-3", decision="allow",
                                reason="rule_matched", rule_id="secrets", policy_name="p", policy_hash=policy.hash,
                                host=connect.host, port=443, facts=connect, state=state, extra=dict(relay)))
    upload = Facts(Operation.HTTP_REQUEST, "uploads.example.com", 443, "https", "PUT", "/x", ADDR)
    assert decide(policy, upload, state, T0 + 1).allowed
    await sink.write(AuditEvent(EventKind.HTTP_REQUEST, int((T0 + 1) * 1e9), "r1", sandbox_id="sbx-3",
                                decision="allow", reason="rule_matched", rule_id="up", policy_name="p",
                                policy_hash=policy.hash, scheme="https", host=upload.host, port=443, method="PUT",
                                path="/x", facts=upload, state=state))
    await sink.close()
    result = replay([sink.path], strict)
    changes = [(c.direction, c.new_reason) for c in result.changes]
    assert changes == ([("allow->deny", "condition_failed")] if relay else [])
