"""`query:` on HTTP rules (policy/querymatch.py): a clone-only git rule must not open a push.

Path rules never see the query string, and git names the operation there (`info/refs?service=...`).
Every adversarial spelling below (reordering, duplicates, percent-encoding, case, `;`, `+`, double
encoding, invalid escapes) must be refused by the clone-only allow rule and by the push deny rule, while
the plain clone request (positive control) is allowed.
"""

from __future__ import annotations

import textwrap

import pytest

from egressgate.policy.decide import decide
from egressgate.policy.errors import PolicyError
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.querymatch import QueryMatcher, parse
from egressgate.policy.reasons import Effect, Reason
from egressgate.policy.target import parse_target

NOW = 1_700_000_000.0
STATE = SandboxState(sandbox_id="s", admitted_at=NOW - 10)

CLONE_ONLY = parse_policy(
    textwrap.dedent("""
    sandbox: {name: git-clone}
    network:
      https:
        allow:
          - id: clone-refs
            host: git.test
            methods: [GET]
            paths: ["/org/repo.git/info/refs"]
            query: {service: [git-upload-pack]}
          - id: clone-pack
            host: git.test
            methods: [POST]
            paths: ["/org/repo.git/git-upload-pack"]
"""),
    "git-clone",
)

NO_PUSH = parse_policy(
    textwrap.dedent("""
    sandbox: {name: git-no-push}
    network:
      https:
        deny:
          - id: no-push
            host: git.test
            query: {service: [git-receive-pack]}
        allow:
          - id: anything
            host: git.test
"""),
    "git-no-push",
)

REFS = "GET https://git.test/org/repo.git/info/refs"
PUSHES = [
    "service=git-receive-pack",
    "service=git-upload-pack&service=git-receive-pack",  # duplicate: a server may take the last
    "service=git-receive-pack&service=git-upload-pack",  # ... or the first
    "x=1&service=git-receive-pack",  # reordered among other parameters
    "SERVICE=git-receive-pack&service=git-upload-pack",  # name case
    "ser%76ice=git-receive-pack&service=git-upload-pack",  # percent-encoded name
    "service=git%2Dreceive%2Dpack",  # percent-encoded value
    "service=git%2dreceive-pack",  # lower-case escape
    "service=git-upload-pack;service=git-receive-pack",  # ';' as a separator
    "service=git-receive-pac%256b",  # decoded twice by some stacks
]
AMBIGUOUS = [
    "service=git-upload-pack%",
    "service=git-upload-pack%zz",
    "service=git-upload-pack%ff",
    "service=git-upload-pack;x=1",
]


def verdict(policy, target: str):
    return decide(policy, parse_target(target), STATE, NOW)


def test_positive_control_the_clone_request_is_allowed() -> None:
    for query in ("service=git-upload-pack", "x=1&service=git-upload-pack", "service=git%2Dupload-pack"):
        d = verdict(CLONE_ONLY, f"{REFS}?{query}")
        assert (d.effect, d.rule_id) == (Effect.ALLOW, "clone-refs"), query
    assert verdict(NO_PUSH, f"{REFS}?service=git-upload-pack").allowed


@pytest.mark.parametrize("query", PUSHES)
def test_a_push_spelling_is_refused_by_the_clone_only_rule(query: str) -> None:
    d = verdict(CLONE_ONLY, f"{REFS}?{query}")
    assert not d.allowed and (d.reason, d.detail) == (Reason.PATH_NOT_ALLOWED, "query"), (query, d)
    assert "service=git-upload-pack" in d.message  # the agent reads what is allowed


@pytest.mark.parametrize("query", PUSHES)
def test_a_push_spelling_is_refused_by_the_deny_rule(query: str) -> None:
    d = verdict(NO_PUSH, f"{REFS}?{query}")
    assert (d.effect, d.reason, d.rule_id) == (Effect.DENY, Reason.DENIED_BY_RULE, "no-push"), (query, d)


@pytest.mark.parametrize("query", AMBIGUOUS)
def test_an_ambiguous_query_fails_closed_both_ways(query: str) -> None:
    assert not verdict(CLONE_ONLY, f"{REFS}?{query}").allowed
    assert verdict(NO_PUSH, f"{REFS}?{query}").reason is Reason.DENIED_BY_RULE


def test_a_missing_parameter_does_not_satisfy_an_allow_rule() -> None:
    for target in (REFS, f"{REFS}?", f"{REFS}?other=1", f"{REFS}?service"):
        assert not verdict(CLONE_ONLY, target).allowed, target
    assert verdict(NO_PUSH, REFS).allowed  # a deny rule's parameter that is absent refuses nothing


def test_plus_is_read_both_ways() -> None:
    matcher = QueryMatcher((("q", frozenset({"a b"})),))
    assert not matcher.allows("q=a+b")  # '+' is also read as itself: not every reading is listed
    assert matcher.denies("q=a+b")  # ... and as a space: a deny rule refuses it
    assert matcher.allows("q=a%20b")


def test_a_connect_is_not_decided_by_query_rules() -> None:
    """The query is decided per request inside the intercepted tunnel, never at the CONNECT."""
    assert verdict(CLONE_ONLY, "CONNECT git.test:443").allowed
    assert verdict(NO_PUSH, "CONNECT git.test:443").allowed


def test_parse_reads_names_lowercased_and_every_value() -> None:
    [(names, values)] = parse("Na%6De=v%2Bw")
    assert names == {"name"} and values == {"v+w"}


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("{}", "an empty query matcher matches nothing"),
        ("{service: []}", "an empty value list matches nothing"),
        ("{'a=b': [x]}", "a parameter name is plain text"),
        ("{Service: [x], service: [y]}", "listed twice"),
    ],
)
def test_bad_query_matchers_are_refused_with_their_key_path(query: str, message: str) -> None:
    text = f"sandbox: {{name: q}}\nnetwork:\n  https:\n    allow:\n      - {{host: git.test, query: {query}}}\n"
    with pytest.raises(PolicyError) as exc:
        parse_policy(text, "q.yaml")
    assert "network.https.allow[0].query" in str(exc.value) and message in str(exc.value)


def test_passthrough_rules_cannot_carry_a_query() -> None:
    text = (
        "sandbox: {name: q}\nnetwork:\n  https:\n    allow:\n"
        "      - {host: git.test, tls: passthrough, query: {service: [x]}}\n"
    )
    with pytest.raises(PolicyError, match=r"allow\[0\]\.query"):
        parse_policy(text, "q.yaml")
