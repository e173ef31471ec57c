"""Hosts, paths, labels and sandbox ids in the trail are the sandbox's to choose: whatever they hold
(`#`, newlines, `: `, quotes, Unicode controls and line separators, 4 kB strings), the learned file means
exactly the rules learned -- it reads back as the same data, compiles, and replays to exactly the learned
flips. Raw (non-canonical) values only a forged file could hold are refused, never written."""

from __future__ import annotations

import textwrap

import pytest

from egressgate.audit.replay import replay_diff
from egressgate.policy.learn import Selector, learn
from egressgate.policy.learn_yaml import YamlWriteError, dump
from egressgate.policy.loader import parse_policy
from egressgate.safeyaml import load_yaml
from tests.policy_learn.conftest import Session, lines

BASE = textwrap.dedent("""\
    sandbox: {name: agent}
    network: {https: {allow: [{id: other, host: other.example.com}]}}
    """)
# canonical paths (what the gateway records) built from hostile input; all top-level: never globbed
HOSTILE_PATHS = [
    "/a%22b'c", "/x%23y:z", "/k:%20v", "/%0A-%20id:%20pwn%0A-%20host:%20%22x%22", "/%E2%80%AE%E2%80%A8",
    "/&anchor", "/!tag", "/@at,b;c=d", "/-", "/%25", "/null", "/true", "/'", "/" + "Z" * 4000,
]
NASTY = ["a: b", "#c", "x\ny", "'\"", "\u202e\u2028\x85", "- [x]", "*alias", "&anchor", "!!python/object",
         "", " lead", "trail ", "{a: 1}", "\ud800", "\U0001f600", "yes", "0x10", "1e3", "~"]


def test_hostile_canonical_paths_and_labels_round_trip_exactly():
    labels = {"team: x\n- id: pwn": "a#b 'c\"\u202e\u2028", "plain": "v"}
    s = Session(BASE)
    s.admit("s1", labels)
    s.admit("s2", {"plain": "v"})
    for p in HOSTILE_PATHS:
        e = s.request("s1", f"GET https://api.example.com{p}")
        assert (e.path, e.reason) == (p, "host_not_allowed"), p
    result = learn(lines(s), Selector(labels=labels))
    doc = load_yaml(result.policy_yaml)
    (rule,) = doc["network"]["https"]["allow"]
    assert rule == {"id": "learned-api.example.com", "host": "api.example.com", "ports": [443], "methods": ["GET"],
                    "paths": sorted(HOSTILE_PATHS), "when": {"labels": labels}}
    compiled = parse_policy(result.policy_yaml, "learned.yaml")
    flips = replay_diff(lines(s), compiled)
    assert len(flips) == len(HOSTILE_PATHS) and {f.sandbox_id for f in flips} == {"s1"}
    for line in result.policy_yaml.splitlines():  # no raw control/non-ASCII character anywhere
        assert line.isascii() and line.isprintable(), line


def test_forged_raw_values_are_refused_never_written():
    s = Session(BASE)
    sid = "s1\n- {id: pwn, host: '*'}"
    s.admit(sid)
    forged = [
        dict(host="evil.com\n      - {host: '*'}", path="/x"),
        dict(host="EVIL.example.com", path="/x"),  # not canonical
        dict(host="ok.example.com", path="/x\n  - id: pwn"),
        dict(host="ok.example.com", path="/a/../b"),
        dict(host="ok.example.com", path="/lit*star"),
        dict(host="ok.example.com", path="/x", method="GET\n"),
        dict(host="*", path="/x"),
    ]
    for f in forged:
        s.recorded(sid, "host_not_allowed", port=443, scheme="https", **{"method": "GET", **f})
    s.request(sid, "GET https://fine.example.com/ok")
    result = learn(lines(s), Selector(sandbox=sid))
    doc = load_yaml(result.policy_yaml)
    assert [r["host"] for r in doc["network"]["https"]["allow"]] == ["fine.example.com"]
    assert result.not_learnable == {"malformed host": 3, "path not expressible": 3, "malformed method": 1}
    # the hostile sandbox id appears once, escaped inside the header comment
    assert [line for line in result.policy_yaml.splitlines() if "pwn" in line] == [
        "# Learned by `egressgate policy learn` from the denied traffic of sandbox s1\\x0a- {id: pwn, host: '*'}."]
    for line in result.policy_yaml.splitlines():
        assert line.isascii() and line.isprintable(), line


@pytest.mark.parametrize("value", NASTY)
def test_writer_round_trips_any_string_as_key_value_and_comment(value):
    data = {"k": [{value: value, "n": [value]}], value: value}
    text = dump(data, [value, "ok"], {(id(data["k"]), 0): [value]})
    assert load_yaml(text) == data


def test_writer_refuses_what_it_cannot_write():
    with pytest.raises(YamlWriteError):
        dump({"k": object()}, [], {})
