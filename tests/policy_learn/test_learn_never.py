"""What `policy learn` never proposes: private, loopback, link-local, metadata addresses in every
spelling (literal, IPv4-mapped, NAT64, decimal), names recorded resolving to them, special-use names,
wildcards wider than observed, credentials. Each case has a positive control: the engine WOULD allow the
refused target if a rule named it (so the learner's refusal is what keeps it closed), and an ordinary host
in the same trail IS learned."""

from __future__ import annotations

import textwrap

from egressgate.audit.event import EventKind
from egressgate.audit.replay import replay_diff
from egressgate.policy.learn import Selector, learn
from egressgate.policy.loader import parse_policy
from egressgate.safeyaml import load_yaml
from tests.policy_learn.conftest import Session, lines

PRIVATE_OK = textwrap.dedent("""\
    sandbox: {name: agent}
    network:
      # every private class is permitted by allow_private, so these requests are denied only as
      # "host_not_allowed": exactly what a naive learner would turn into rules
      allow_private: [10.0.0.0/8, 192.168.0.0/16, 127.0.0.0/8, 169.254.0.0/16, "fe80::/10", "fd00::/8"]
      https:
        allow:
          - {id: known, host: known.example.com}
    """)

PRIVATE_URLS = {
    "GET https://10.1.2.3/x": "10.1.2.3",
    "GET https://[::ffff:10.1.2.3]/x": "::ffff:10.1.2.3",  # IPv4-mapped
    "GET https://[64:ff9b::a01:204]/x": "64:ff9b::a01:204",  # NAT64 of 10.1.2.4
    "GET https://167772165/x": "10.0.0.5",  # decimal spelling, canonicalized by the gateway
    "GET https://0x7f.1/x": "127.0.0.1",  # hex/short spelling of loopback
    "GET https://192.168.1.1/x": "192.168.1.1",
    "GET https://169.254.10.10/x": "169.254.10.10",  # link-local
    "GET https://[fe80::1]/x": "fe80::1",
    "GET https://[fd00::5]/x": "fd00::5",
}


def _private_session() -> Session:
    s = Session(PRIVATE_OK)
    s.admit("s1")
    for url, host in PRIVATE_URLS.items():
        e = s.request("s1", url)
        assert (e.host, e.reason) == (host, "host_not_allowed"), (url, e.host, e.reason)
    # a name the trail shows resolving to a private address (its dial addresses were recorded)
    assert s.request("s1", "GET https://db.corp-internal.com/x", addresses=("10.0.0.9",)).reason == "host_not_allowed"
    # a name another sandbox's DNS answer shows resolving to loopback (evidence, whoever recorded it)
    s.admit("s9")
    s.recorded("s9", "rule_matched", kind=EventKind.DNS_QUERY, host="cache.example.com", qtype="A",
               answers=["127.0.0.1"]).decision = "allow"
    assert s.request("s1", "GET https://cache.example.com/x").reason == "host_not_allowed"
    for url in ("GET https://localhost/x", "GET https://printer.local/x", "GET https://x.localhost/x",
                "GET https://svc.internal/x", "GET https://router.home.arpa/x"):
        assert s.request("s1", url).reason == "host_not_allowed", url
    assert s.request("s1", "GET https://metadata.google.internal/x").reason == "metadata_endpoint"
    assert s.request("s1", "GET https://169.254.169.254/latest").reason == "metadata_endpoint"
    assert s.request("s1", "GET https://good.example.org/ok").reason == "host_not_allowed"
    return s


def test_never_private_loopback_link_local_metadata_or_names_resolving_to_them():
    s = _private_session()
    result = learn(lines(s), Selector(sandbox="s1"), base_yaml=PRIVATE_OK)
    doc = load_yaml(result.policy_yaml)
    learned = [r for r in doc["network"]["https"]["allow"] if r["id"].startswith("learned")]
    assert [(r["host"], r["paths"]) for r in learned] == [("good.example.org", ["/ok"])]  # positive control
    assert "dns" not in doc["network"]
    for host in [*PRIVATE_URLS.values(), "db.corp-internal", "cache.example.com", "localhost", ".local",
                 ".internal", "home.arpa", "169.254.169.254", "metadata.google"]:
        assert host not in result.policy_yaml, host
    assert result.not_learnable == {
        "private address": 5, "loopback address": 1, "link_local address": 2, "ula address": 1,
        "resolves to a private address": 1, "resolves to a loopback address": 1,
        "single-label name": 1, "special-use name": 4, "metadata_endpoint": 2,
    }
    assert [f.target for f in result.flips] == ["https://good.example.org:443/ok"]


def test_control_the_engine_would_allow_those_targets_if_a_rule_named_them():
    """Without the learner's refusal these rules would open every private target above."""
    s = _private_session()
    rules = "".join(f"      - {{host: \"{h}\"}}\n" for h in PRIVATE_URLS.values())
    opened = parse_policy(PRIVATE_OK + rules + "      - {host: db.corp-internal.com}\n", "naive.yaml")
    flipped = {f.target.split("/")[2].rsplit(":", 1)[0].strip("[]")
               for f in replay_diff(lines(s), opened, sandbox="s1")}
    assert flipped >= {*PRIVATE_URLS.values(), "db.corp-internal.com"}


WILD = textwrap.dedent("""\
    sandbox: {name: agent}
    network: {}
    """)


def _learn_hosts(requests: list[str], extra=None) -> tuple[dict, object]:
    s = Session(WILD)
    s.admit("s1")
    for r in requests:
        s.request("s1", r)
    if extra:
        extra(s)
    result = learn(lines(s), Selector(sandbox="s1"))
    doc = load_yaml(result.policy_yaml)
    return {r["host"]: r for r in doc["network"]["https"]["allow"]}, result


def test_wildcards_only_over_two_observed_subdomains_never_public_suffixes_or_star():
    rules, result = _learn_hosts([
        "GET https://a.svc.example.com/v", "GET https://b.svc.example.com/v",  # -> *.svc.example.com
        "GET https://one.solo.example.com/v",  # a single subdomain stays exact
        "GET https://x.github.io/v", "GET https://y.github.io/v",  # public suffix: exact
        "GET https://foo.com/v", "GET https://bar.com/v",  # single-label parent: exact
        "GET https://p.co.uk/v", "GET https://q.co.uk/v",
        "GET https://c.svc2.example.com/a", "POST https://d.svc2.example.com/b",  # different rules: exact
    ])
    assert set(rules) == {"*.svc.example.com", "one.solo.example.com", "x.github.io", "y.github.io", "foo.com",
                          "bar.com", "p.co.uk", "q.co.uk", "c.svc2.example.com", "d.svc2.example.com"}
    assert "learned-any.svc.example.com" in result.policy_yaml and "wildcard over 2 observed hosts" in \
        result.policy_yaml
    assert len(result.flips) == 11 and {f.direction for f in result.flips} == {"deny->allow"}


def test_no_wildcard_over_a_parent_holding_a_refused_host():
    def private_sibling(s):
        s.recorded("s1", "host_not_allowed", host="g.svc3.example.com", port=443, scheme="https", method="GET",
                   path="/v", extra={"facts.addresses": ["10.0.0.1"]})

    rules, result = _learn_hosts(["GET https://e.svc3.example.com/v", "GET https://f.svc3.example.com/v"],
                                 private_sibling)
    assert set(rules) == {"e.svc3.example.com", "f.svc3.example.com"}
    assert result.not_learnable == {"resolves to a private address": 1}


def test_globs_only_for_three_paths_under_one_non_root_parent():
    rules, _ = _learn_hosts(["GET https://api.example.com/r/1", "GET https://api.example.com/r/2",
                             "GET https://api.example.com/s/1", "GET https://api.example.com/s/2",
                             "GET https://api.example.com/s/3", "GET https://api.example.com/a",
                             "GET https://api.example.com/b", "GET https://api.example.com/c",
                             "GET https://api.example.com/t/x%2Fy", "GET https://api.example.com/t/2",
                             "GET https://api.example.com/t/3"])
    # /r: 2 paths (exact); /s: 3 (glob); root: never /*; /t: `*` never matches %2F, so only 2 match
    assert rules["api.example.com"]["paths"] == ["/a", "/b", "/c", "/r/1", "/r/2", "/s/*", "/t/2", "/t/3",
                                                 "/t/x%2Fy"]


def test_never_a_credential_in_a_learned_path():
    token = "egph_" + "ab" * 24
    rules, result = _learn_hosts([
        f"GET https://api.example.com/bot{token}/send", "GET https://api.example.com/ok",
        "GET https://api.example.com/u/ghp_" + "A" * 36, "GET https://api.example.com/k/sk-" + "x" * 40,
        "GET https://api.example.com/j/eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.sig",
        "GET https://api.example.com/creds/AKIAABCDEFGHIJKLMNOP",
    ], lambda s: s.recorded("s1", "host_not_allowed", host="api.example.com", port=443, scheme="https",
                            method="GET", path="/bot/egph_[REDACTED]/x"))
    assert rules["api.example.com"]["paths"] == ["/ok"]
    assert result.not_learnable == {"credential in path": 6}
    for secret in ("egph", "ghp_", "sk-x", "eyJ", "AKIA"):
        assert secret not in result.policy_yaml
