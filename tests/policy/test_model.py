"""The policy language: the article's policy loads unchanged; every mistake names file and key path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from egressgate.policy.errors import PolicyError
from egressgate.policy.loader import load_policies, load_policy, parse_policy

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "policies" / "seed-invoice-analysis.yaml"

BASE = """
sandbox:
  name: t
network:
  https:
    allow:
      - host: api.example.com
"""


def load(text: str):
    return parse_policy(textwrap.dedent(text), "p.yaml")


def problems(text: str) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        load(text)
    assert str(info.value).startswith("p.yaml: ")
    return info.value.problems


def test_seed_policy_loads_unchanged():
    policy = load_policy(SEED)
    assert policy.name == "invoice-analysis"
    assert policy.outbound_bytes_max == 10485760
    assert policy.model.sandbox.workspace.max_bytes == 536870912
    assert policy.model.filesystem.deny == ["/etc/shadow", "/var/run/docker.sock", "/proc/kcore", "/sys"]
    assert policy.model.execution.require_approval_for == ["network_expansion", "persistent_write", "publish"]
    assert policy.model.credentials.max_ttl_seconds == 300
    assert [r.id for r in policy.rules] == ["https.allow[0]", "https.allow[1]"]
    assert policy.hash.startswith("sha256:") and len(policy.hash) == 71


def test_hash_is_stable_across_formatting_and_changes_with_meaning():
    a = load(BASE)
    reformatted = load("""
    # same meaning: flow style, other key order, defaults spelled out
    network: {https: {allow: [{host: api.example.com}], deny: []}, default: deny}
    sandbox: {name: t}
    """)
    assert reformatted.hash == a.hash
    changed = load(BASE.replace("api.example.com", "api2.example.com"))
    assert changed.hash != a.hash


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        (BASE + "    deny: []\n  bogus: 1\n", "network.bogus", "unknown key"),
        (BASE.replace("- host: api.example.com", "- host: api.example.com\n        methods: [GET, 7]"),
         "network.https.allow[0].methods[1]", "string"),
        (BASE.replace("- host: api.example.com", "- host: api.example.com\n        methods: [get]"),
         "network.https.allow[0].methods[0]", "case-sensitive"),
        (BASE.replace("- host: api.example.com", "- host: api.example.com\n        paths: [/v1/**x]"),
         "network.https.allow[0].paths[0]", "whole path segment"),
        (BASE.replace("- host: api.example.com", "- host: api.example.com\n        paths: [v1]"),
         "network.https.allow[0].paths[0]", "start with '/'"),
        (BASE.replace("- host: api.example.com", "- host: api.example.com\n        paths: ['/a/../b']"),
         "network.https.allow[0].paths[0]", "dot segments"),
        (BASE.replace("api.example.com", "'*'"), "network.https.allow[0].host", "only valid in deny"),
        (BASE.replace("api.example.com", "api.*.com"), "network.https.allow[0].host", "bad host pattern"),
        (BASE.replace("api.example.com", "user@api.example.com"), "network.https.allow[0].host", "bad host"),
        (BASE.replace("- host: api.example.com", "- host: api.example.com\n        ports: [0]"),
         "network.https.allow[0].ports[0]", "greater than or equal to 1"),
        (BASE.replace("- host: api.example.com", "- host: api.example.com\n        ports: ['443']"),
         "network.https.allow[0].ports[0]", "integer"),
        (BASE + "  allow_private: [10.0.0.1/8]\n", "network.allow_private[0]", "CIDR"),
        (BASE + "  default: allow\n", "network.default", "'deny'"),
        (BASE + "  metadata_endpoints: allow\n", "network.metadata_endpoints", "'deny'"),
        (BASE.replace("- host: api.example.com", "- host: api.example.com\n        credential: nope"),
         "network.https.allow[0].credential", "unknown capability"),
        (BASE.replace("- host: api.example.com", "- host: api.example.com\n        budget: {requests: 0}"),
         "network.https.allow[0].budget.requests", "greater than 0"),
        ("sandbox: {name: Bad Name}\n", "sandbox.name", "pattern"),
        ("sandbox: {name: t, tmp: {max_bytes: 0}}\n", "sandbox.tmp.max_bytes", "greater than 0"),
        ("sandbox: {name: t, tmp: {max_bytes: 1MiB}}\n", "sandbox.tmp.max_bytes", "integer"),
        ("sandbox: {name: t, tmp: {size: 1}}\n", "sandbox.tmp.size", "unknown key"),
        ("network: {}\n", "sandbox", "required"),
    ],
)
def test_errors_name_the_key_path(text, path, fragment):
    found = problems(text)
    assert any(p == path and fragment.lower() in m.lower() for p, m in found), found


CREDS = """
sandbox: {name: t}
credentials:
  capabilities:
    a: {type: jwt}
    b: {type: jwt}
network:
  https:
    allow:
"""


def test_overlapping_credential_bindings_are_errors():
    text = CREDS + """
      - {host: api.example.com, methods: [POST], credential: a}
      - {host: api.example.com, paths: ['/v1/**'], credential: b}
"""
    found = problems(text)
    assert any(p == "network.https.allow[1].credential" and "overlaps" in m for p, m in found), found


def test_disjoint_credential_bindings_are_fine():
    text = CREDS + """
      - {host: api.example.com, methods: [POST], credential: a}
      - {host: api.example.com, methods: [GET], credential: b}
      - {host: other.example.com, credential: b}
"""
    policy = load(text)
    assert [r.credential for r in policy.rules] == ["a", "b", "b"]


@pytest.mark.parametrize(
    ("rule", "fragment"),
    [
        ("{host: '*.example.com', credential: a}", "exact host"),
        ("{host: api.example.com, credential: a, ports: [443]}\n      - {host: x.example.com}", None),
    ],
)
def test_wildcard_hosts_cannot_carry_credentials(rule, fragment):
    text = CREDS + f"      - {rule}\n"
    if fragment is None:
        load(text)
        return
    found = problems(text)
    assert any(fragment in m for _, m in found), found


def test_trace_with_a_credential_is_an_error():
    found = problems(CREDS + "      - {host: api.example.com, methods: [GET, TRACE], credential: a}\n")
    assert any(p == "network.https.allow[0].methods" and "TRACE" in m for p, m in found), found


def test_credentials_only_on_https_allow_rules():
    text = """
sandbox: {name: t}
credentials: {capabilities: {a: {type: jwt}}}
network:
  http: {allow: [{host: api.example.com, credential: a}]}
  https: {deny: [{host: api.example.com, credential: a}]}
"""
    found = dict(problems(text))
    assert "HTTPS" in found["network.http.allow[0].credential"]
    assert "deny rules" in found["network.https.deny[0].credential"]


def test_duplicate_rule_ids_and_yaml_keys_are_errors():
    found = problems("""
sandbox: {name: t}
network:
  https:
    allow:
      - {id: r1, host: a.example.com}
      - {id: r1, host: b.example.com}
""")
    assert any(p == "network.https.allow[1].id" and "duplicate" in m for p, m in found)
    found = problems("sandbox: {name: t}\nsandbox: {name: u}\n")
    assert "duplicate key" in found[0][1]


def test_directory_loads_many_policies_keyed_by_name(tmp_path):
    (tmp_path / "a.yaml").write_text("sandbox: {name: alpha}\n")
    (tmp_path / "b.yml").write_text("sandbox: {name: beta}\n")
    (tmp_path / "notes.txt").write_text("ignored")
    assert sorted(load_policies(tmp_path)) == ["alpha", "beta"]
    (tmp_path / "c.yaml").write_text("sandbox: {name: alpha}\n")
    with pytest.raises(PolicyError) as info:
        load_policies(tmp_path)
    assert "c.yaml: sandbox.name" in str(info.value)


def test_directory_reports_every_bad_file(tmp_path):
    (tmp_path / "a.yaml").write_text("sandbox: {name: alpha, extra: 1}\n")
    (tmp_path / "b.yaml").write_text("sandbox: {name: beta}\nnetwork: {https: {allow: [{host: 'a b'}]}}\n")
    with pytest.raises(PolicyError) as info:
        load_policies(tmp_path)
    text = str(info.value)
    assert "a.yaml: sandbox.extra: unknown key" in text
    assert "b.yaml: network.https.allow[0].host" in text


def test_invalid_yaml_names_line():
    found = problems("sandbox: {name: t\n")
    assert found[0][0].startswith("line ")


def test_tmp_max_bytes_defaults_to_256_mib():
    policy = parse_policy("sandbox: {name: t}\n", "t.yaml")
    assert policy.model.sandbox.tmp.max_bytes == 256 * 1024 * 1024
    assert parse_policy("sandbox: {name: t, tmp: {max_bytes: 4096}}\n", "t.yaml").model.sandbox.tmp.max_bytes == 4096
