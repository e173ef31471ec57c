"""replay_diff: the console's pure replay -- the same machinery as `audit replay` (replay_records), over
records from anywhere, narrowed by sandbox, start time and a limit."""

from __future__ import annotations

import json
import textwrap

from egressgate.audit.find import iter_records
from egressgate.audit.replay import replay, replay_diff
from egressgate.policy.loader import parse_policy
from tests.policy_learn.conftest import T0, Session, lines

OLD = textwrap.dedent("""\
    sandbox: {name: agent}
    network:
      https:
        allow:
          - {id: gh, host: api.github.com, methods: [GET]}
    """)
NEW = textwrap.dedent("""\
    sandbox: {name: agent}
    execution: {package_install: allow}  # GET /simple/ is a package index request (docs/policy.md)
    network:
      https:
        allow:
          - {id: gh, host: api.github.com, methods: [GET], budget: {requests: 2}}
          - {id: pypi, host: pypi.org, methods: [GET]}
    """)


def _session() -> Session:
    s = Session(OLD)
    for sid in ("s1", "s2"):
        s.admit(sid)
    for i in range(4):  # under NEW the 3rd and 4th exceed the budget (history counts, even before since)
        s.request("s1", f"GET https://api.github.com/r/{i}", at=10 + i)
    s.request("s1", "GET https://pypi.org/simple/", at=20)
    s.request("s2", "GET https://pypi.org/simple/", at=21)
    s.request("s2", "GET https://api.github.com/r/x", at=22)
    return s


def _ids(flips) -> list[tuple[str, str]]:
    return [(f.request_id, f.direction) for f in flips]


async def test_replay_diff_matches_audit_replay_and_accepts_records_from_anywhere(tmp_path, signer):
    s = _session()
    new = parse_policy(NEW, "new.yaml")
    path = await s.write(tmp_path / "audit.jsonl", signer)
    (tmp_path / "new.yaml").write_text(NEW)
    from_file = replay([path], tmp_path / "new.yaml").changes
    assert [(c.target, c.direction) for c in from_file] == [
        ("https://api.github.com:443/r/2", "allow->deny"), ("https://api.github.com:443/r/3", "allow->deny"),
        ("https://pypi.org:443/simple/", "deny->allow"), ("https://pypi.org:443/simple/", "deny->allow")]
    expected = _ids(from_file)
    assert _ids(replay_diff(iter_records([path]), new)) == expected
    assert _ids(replay_diff(s.records(), new)) == expected
    assert _ids(replay_diff(lines(s), new)) == expected
    assert _ids(replay_diff([b"not json", *(x.decode() for x in lines(s))], new)) == expected
    assert _ids(replay_diff(lines(s), {"agent": new})) == expected
    assert _ids(replay_diff([json.loads(x) for x in lines(s)], new)) == expected  # AuditIndex.record() docs
    assert replay_diff(lines(s), {"other-name": new}) == []  # matched by policy name, like a directory
    flip = replay_diff(lines(s), new)[0].to_json()
    assert flip["sandbox"] == "s1" and flip["new"] == {"decision": "deny", "rule": "gh", "reason": "budget_exceeded"}


def test_sandbox_since_and_limit():
    s = _session()
    new = parse_policy(NEW, "new.yaml")
    only_s2 = replay_diff(lines(s), new, sandbox="s2")
    assert [(f.sandbox_id, f.target) for f in only_s2] == [("s2", "https://pypi.org:443/simple/")]
    # records before `since` are not re-decided but still count in the sandbox's history (the budget)
    late = replay_diff(lines(s), new, since_ns=int((T0 + 13) * 1e9))
    assert [f.target for f in late] == ["https://api.github.com:443/r/3", "https://pypi.org:443/simple/",
                                        "https://pypi.org:443/simple/"]
    assert len(replay_diff(lines(s), new, limit=1)) == 1
