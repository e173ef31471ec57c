"""`query:` rules through the real gateway (issue 21 item 5): under a clone-only git rule,
`GET …/info/refs?service=git-receive-pack` (the first request of a push) never reaches the server, in
any spelling; the clone's `?service=git-upload-pack` does (positive control). The decision record
carries the query, so `audit replay` re-decides it the same way.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from egressgate.audit.replay import facts_from
from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import load_policy
from tests.escape.checks import SETTLE, requests_on
from tests.networld import World
from tests.support.netgateway import Gateway

pytestmark = pytest.mark.netns

REFS = "https://api.allowed.test/org/repo.git/info/refs"
PUSHES = [
    "service=git-receive-pack",
    "service=git-upload-pack&service=git-receive-pack",
    "SERVICE=git-receive-pack&service=git-upload-pack",
    "service=git%2Dreceive%2Dpack",
    "service=git-upload-pack;service=git-receive-pack",
    "ser%76ice=git-receive-pack&service=git-upload-pack",
]


@pytest.mark.parametrize("query", PUSHES)
def test_a_push_never_reaches_the_server_under_a_clone_only_rule(world: World, gateway: Gateway, query: str) -> None:
    sbx = gateway.admit("escape-git-query")
    mark = world.mark()
    res = gateway.curl(sbx, f"{REFS}?{query}")
    assert res.status == 403, res
    body = res.deny_body()
    assert body["reason"] == "path_not_allowed" and "service=git-upload-pack" in body["message"], body
    record = gateway.audit_record(body["request_id"])
    assert record["egressgate.detail"] == "query" and record["url.query"] == query, record
    # replay: the record's facts include the query, and re-deciding them gives the same refusal
    policy = load_policy(Path(__file__).with_name("policies") / "escape-git-query.yaml")
    replayed = decide(policy, facts_from(record), SandboxState(sandbox_id=sbx.id, admitted_at=0.0), time.time())
    assert (replayed.reason, replayed.detail) == ("path_not_allowed", "query"), replayed
    time.sleep(SETTLE)
    assert requests_on(world, mark, "upstream-tls") == []
    # positive control: the clone's request reaches the server
    ok = gateway.curl(sbx, f"{REFS}?service=git-upload-pack")
    assert ok.status == 200 and not ok.denied, ok
    assert [r["target"] for r in requests_on(world, mark, "upstream-tls")] == [
        "/org/repo.git/info/refs?service=git-upload-pack"
    ]
