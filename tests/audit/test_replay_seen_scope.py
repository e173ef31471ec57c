"""Replay of concurrent requests under a `when` about the sandbox's history (issue 25, h-core item 3).

Two requests of one sandbox decided at once read the same snapshot: neither had seen the other's host.
The gateway writes each record when its own pipeline gets there, so the record of the request decided on
"secrets.example.com not seen" can come *after* the record of the request to secrets.example.com. Replay
used to merge the log's history into every recorded `seen_hosts`, so that later record saw the host and
its `unless_request_to: [secrets.example.com]` flipped allow -> deny, although the same policy allowed it
(the same kind of bug as the zero rule usage, tests/audit/test_replay_budget_zero.py). A record now states
which hosts its `seen_hosts` answers for (`egressgate.state.seen_scope`: the recording policy's `when`
patterns), and replay takes exactly the recorded answer for those; only hosts outside it come from the log.
"""

from __future__ import annotations

import ipaddress
import textwrap

from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.find import Found, iter_records
from egressgate.audit.record import Record
from egressgate.audit.replay import load_policy_set, replay, replay_records
from egressgate.policy.decide import decide
from egressgate.policy.facts import Facts, Operation, SandboxState
from egressgate.policy.loader import load_policy

LIVE = """
sandbox: {name: exfil}
network:
  allow_private: [198.18.0.0/15]
  https:
    allow:
      - {id: secrets, host: secrets.example.com}
      - {id: other, host: other.example.com}
      - {id: up, host: uploads.example.com, methods: [PUT], when: {unless_request_to: [secrets.example.com]}}
"""
# the same, and uploads also refused after a request to other.example.com (a host LIVE never asked about)
STRICTER = LIVE.replace(
    "unless_request_to: [secrets.example.com]", "unless_request_to: [secrets.example.com, other.example.com]"
)
# another version of LIVE (its hash differs) that decides this module's requests the same way
LIVE_V2 = LIVE + "      - {id: v2, host: v2.example.com}\n"
T0 = 1_795_000_000.0
ADDR = (ipaddress.ip_address("198.18.0.10"),)
SECRETS = Facts(Operation.HTTP_REQUEST, "secrets.example.com", 443, "https", "GET", "/key", ADDR)
OTHER = Facts(Operation.HTTP_REQUEST, "other.example.com", 443, "https", "GET", "/", ADDR)
UPLOAD = Facts(Operation.HTTP_REQUEST, "uploads.example.com", 443, "https", "PUT", "/x", ADDR)
UPLOAD_TARGET = "https://uploads.example.com:443/x"  # how replay names it (egressgate.target.canonical)


def write_policy(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


async def record(sink, policy, i: int, facts: Facts, seen: set[str]) -> str:
    """What the gateway writes for one request decided on a snapshot that had seen `seen`: the state
    reduced by the live policy (CompiledPolicy.relevant_state), as flow_decision.py records it."""
    state = policy.relevant_state(SandboxState("sbx-1", T0, seen_hosts=frozenset(seen)))
    now = T0 + 1 + i / 1000
    d = decide(policy, facts, state, now)
    await sink.write(
        AuditEvent(
            EventKind.HTTP_REQUEST,
            int(now * 1e9),
            f"r{i}",
            sandbox_id="sbx-1",
            decision=str(d.effect),
            reason=str(d.reason),
            rule_id=d.rule_id,
            policy_name=policy.name,
            policy_hash=policy.hash,
            scheme="https",
            host=facts.host,
            port=443,
            method=facts.method,
            path=facts.path,
            facts=facts,
            state=state,
        )
    )
    return str(d.effect)


async def concurrent_trail(make_sink, policy):
    """other.example.com first (sequential), then the upload and the secrets request decided at once on
    {other.example.com}; the secrets request's record is written first."""
    sink = await make_sink()
    assert await record(sink, policy, 0, OTHER, set()) == "allow"
    assert await record(sink, policy, 1, SECRETS, {"other.example.com"}) == "allow"
    assert await record(sink, policy, 2, UPLOAD, {"other.example.com"}) == "allow"  # did not see secrets
    await sink.close()
    return sink.path


def without_scope(found: Found) -> Found:
    """The record as written before records carried `egressgate.state.seen_scope`."""
    attrs = {k: v for k, v in found.record.attributes.items() if k != "egressgate.state.seen_scope"}
    r = found.record
    return Found(
        found.path,
        found.line,
        found.raw,
        Record(r.time_ns, r.severity_number, r.severity_text, r.event_name, r.body, attrs),
    )


async def test_a_host_seen_concurrently_does_not_flip_the_replay(make_sink, tmp_path):
    path = write_policy(tmp_path, "live.yaml", LIVE)
    policy = load_policy(path)
    trail = await concurrent_trail(make_sink, policy)
    result = replay([trail], path)
    assert result.changes == [] and result.replayed == 3 and result.approximated_state == 0
    upload = [f.record.attributes for f in iter_records([trail]) if f.record.attributes.get("url.path") == "/x"]
    assert [(a["egressgate.state.seen_hosts"], a.get("egressgate.state.seen_scope")) for a in upload] == [
        ([], ["secrets.example.com"])
    ]  # what it saw, and which hosts that answers for


async def test_old_records_without_a_scope(make_sink, tmp_path):
    """Records written before `seen_scope`: replayed under the very policy that wrote them (same hash),
    its `when` patterns are the scope, so the concurrent upload stays allowed; under any other policy the
    recording scope is unknown and the whole history is merged, as before (the flip this item fixed)."""
    path = write_policy(tmp_path, "live.yaml", LIVE)
    policy = load_policy(path)
    trail = [without_scope(f) for f in iter_records([await concurrent_trail(make_sink, policy)])]
    assert replay_records(trail, *load_policy_set(path)).changes == []
    # another version of the policy (one more rule, for another host): the old merge
    other = load_policy(write_policy(tmp_path, "live2.yaml", LIVE_V2))
    assert other.hash != policy.hash
    flips = replay_records(trail, {"exfil": other}, None).changes
    assert [(c.target, c.direction, c.new_reason) for c in flips] == [
        (UPLOAD_TARGET, "allow->deny", "condition_failed")
    ]


async def test_positive_control_history_outside_the_scope_still_flips(make_sink, tmp_path):
    """A replayed policy asking about a host the recording policy did not (other.example.com) reads it
    from the log's history: the upload, made after a request to other.example.com, flips under it."""
    live = load_policy(write_policy(tmp_path, "live.yaml", LIVE))
    trail = await concurrent_trail(make_sink, live)
    flips = replay([trail], write_policy(tmp_path, "stricter.yaml", STRICTER)).changes
    assert [(c.target, c.direction, c.new_reason) for c in flips] == [
        (UPLOAD_TARGET, "allow->deny", "condition_failed")
    ]


async def test_positive_control_a_recorded_sighting_still_denies(make_sink, tmp_path):
    """Sequential requests: the upload decided after the secrets request was counted saw it (recorded),
    was refused, and replays refused; a policy without the condition flips it to allow."""
    path = write_policy(tmp_path, "live.yaml", LIVE)
    policy = load_policy(path)
    sink = await make_sink()
    assert await record(sink, policy, 0, SECRETS, set()) == "allow"
    assert await record(sink, policy, 1, UPLOAD, {"secrets.example.com"}) == "deny"
    await sink.close()
    assert replay([sink.path], path).changes == []
    open_policy = write_policy(
        tmp_path, "open.yaml", LIVE.replace(", when: {unless_request_to: [secrets.example.com]}", "")
    )
    flips = replay([sink.path], open_policy).changes
    assert [(c.target, c.direction) for c in flips] == [(UPLOAD_TARGET, "deny->allow")]


async def test_a_forged_scope_answers_for_nothing(make_sink, tmp_path):
    """A scope that is not a list of host patterns is ignored (the whole history is merged), never a
    traceback in the auditor's tool."""
    path = write_policy(tmp_path, "live.yaml", LIVE)
    policy = load_policy(path)
    found = list(iter_records([await concurrent_trail(make_sink, policy)]))
    for bad in ([{"x": 1}], ["*.*.bad"], "secrets.example.com"):
        forged = []
        for f in found:
            attrs = dict(f.record.attributes)
            if "egressgate.state.seen_scope" in attrs:
                attrs["egressgate.state.seen_scope"] = bad
            r = f.record
            forged.append(
                Found(
                    f.path,
                    f.line,
                    f.raw,
                    Record(r.time_ns, r.severity_number, r.severity_text, r.event_name, r.body, attrs),
                )
            )
        other = load_policy(write_policy(tmp_path, "live2.yaml", LIVE_V2))
        flips = replay_records(forged, {"exfil": other}, None).changes
        assert [c.direction for c in flips] == ["allow->deny"], bad
