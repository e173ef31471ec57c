"""The learned file must load wherever the base loads: the loader's limits (policy/limits.py) are kept --
rules are split or dropped (counted, most-used kept), never a file `policy check` refuses -- and a base
whose YAML aliases share one `allow` list does not get the learned rules in every aliasing section."""

from __future__ import annotations

import textwrap

from egressgate.audit.replay import replay_diff
from egressgate.policy.learn import Selector, learn
from egressgate.policy.limits import MAX_PATHS_PER_RULE, MAX_POLICY_BYTES, MAX_RULES
from egressgate.policy.loader import parse_policy
from egressgate.safeyaml import load_yaml
from tests.policy_learn.conftest import Session, lines

EMPTY = "sandbox: {name: agent}\n"


def _learned(result) -> list[dict]:
    doc = load_yaml(result.policy_yaml)
    return [r for r in doc["network"]["https"]["allow"] if r["id"].startswith("learned")]


def test_many_paths_are_split_across_rules_and_deep_paths_refused():
    s = Session(EMPTY)
    s.admit("s1")
    for i in range(MAX_PATHS_PER_RULE + 10):
        s.request("s1", f"GET https://api.example.com/p{i}")  # root level: never globbed
    s.request("s1", "GET https://api.example.com" + "/d" * 40)
    result = learn(lines(s), Selector(sandbox="s1"))
    rules = _learned(result)
    assert [len(r["paths"]) for r in rules] == [MAX_PATHS_PER_RULE, 10]
    assert result.not_learnable == {"path too long for a policy": 1}
    assert len(replay_diff(lines(s), parse_policy(result.policy_yaml, "out"))) == MAX_PATHS_PER_RULE + 10


def test_rule_limit_keeps_the_most_used_rules():
    base = EMPTY + "network:\n  dns:\n    allow: [" + ", ".join(f"n{i}.example.com" for i in range(MAX_RULES - 2)) \
        + "]\n"
    s = Session(EMPTY)  # the DNS names change no HTTPS decision: recorded under the small policy
    s.admit("s1")
    for host, n in (("a.example.org", 3), ("b.example.org", 2), ("c.example.org", 1)):
        for i in range(n):
            s.request("s1", f"GET https://{host}/x{i}")
    result = learn(lines(s), Selector(sandbox="s1"), base_yaml=base)  # its output was compiled by the loader
    assert [r.host for r in result.rules] == ["a.example.org", "b.example.org"]
    assert result.not_learnable == {"over the policy's rule limit": 1}
    assert result.policy_yaml.count("- n") == MAX_RULES - 2


def test_size_limit_keeps_the_most_used_rules():
    s = Session(EMPTY)
    s.admit("s1")
    long = "x" * 4000
    for i in range(200):
        s.request("s1", f"GET https://big.example.com/{i}{long}")
    for i in range(100):
        s.request("s1", f"GET https://small.example.com/{i}{long}")
    result = learn(lines(s), Selector(sandbox="s1"))  # its output was compiled by the loader
    assert [r.host for r in result.rules] == ["big.example.com"]
    assert result.not_learnable == {"over the policy size limit": 100}
    assert MAX_POLICY_BYTES * 3 // 4 < len(result.policy_yaml.encode()) <= MAX_POLICY_BYTES


def test_aliased_sections_of_the_base_are_not_widened():
    base = textwrap.dedent("""\
        sandbox: {name: agent}
        network:
          https: &shared
            allow: [{host: known.example.com, ports: [443, 80]}]
          http: *shared
        """)
    s = Session(base)
    s.admit("s1")
    s.request("s1", "GET https://new.example.com/x")
    result = learn(lines(s), Selector(sandbox="s1"), base_yaml=base)
    doc = load_yaml(result.policy_yaml)
    assert [r["host"] for r in doc["network"]["https"]["allow"]] == ["known.example.com", "new.example.com"]
    assert [r["host"] for r in doc["network"]["http"]["allow"]] == ["known.example.com"]  # not plain http too
