"""Argument constraints under attack: every smuggling spelling is refused, the plain allowed value passes."""

from __future__ import annotations

import pytest

from egressgate.policy.mcp_path import PathRefused, canon_tool_path
from egressgate.policy.reasons import Reason
from tests.policy.mcp_support import call, policy

P = policy()


def search(**arguments):
    return call(P, "search_tickets", {"project": "acme", **arguments})


def refused(decision, argument: str, detail: str) -> None:
    assert not decision.allowed, decision
    assert decision.reason is Reason.MCP_ARGUMENT_DENIED
    assert (decision.failed_argument, decision.detail) == (argument, detail)
    assert decision.rule_id == "tickets-search" and decision.message.endswith(".")


# --- path_prefix ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/workspace/a.txt", "/workspace/dir/b", "/workspace/", "/workspace",
                                  "/workspace/.hidden", "/workspace/a..b", "/workspace/café.txt"])
def test_path_prefix_positive_controls(path):
    assert search(path=path).allowed


@pytest.mark.parametrize(("path", "detail"), [
    ("/workspace/../etc/passwd", "path:dot_segment"),
    ("/workspace/./a", "path:dot_segment"),
    ("/workspace/...", "path:dot_segment"),
    ("/workspace/%2e%2e/etc/passwd", "path:percent"),
    ("/workspace/%2E%2E%2Fetc", "path:percent"),
    ("/workspace//etc/passwd", "path:empty_segment"),
    ("//workspace/a", "path:empty_segment"),
    ("/workspace\\..\\etc\\passwd", "path:backslash"),
    ("/workspace/a\x00/../../etc/passwd", "path:control_char"),
    ("/workspace/a\n", "path:control_char"),
    ("/workspace/\u2025/etc/passwd", "path:unicode"),  # TWO DOT LEADER: '..' after NFKC
    ("/workspace/\u2024\u2024/etc", "path:unicode"),  # ONE DOT LEADER x2
    ("/workspace/\uff0e\uff0e/etc", "path:unicode"),  # FULLWIDTH FULL STOP
    ("/workspace\uff0f..\uff0fetc", "path:unicode"),  # FULLWIDTH SOLIDUS
    ("workspace/a", "path:not_absolute"),
    ("/workspacex/a", "path_prefix"),
    ("/workspace-evil/a", "path_prefix"),
    ("/etc/passwd", "path_prefix"),
    ("/", "path_prefix"),
    ("/workspace/" + "a/" * 3000, "path:too_long"),
])
def test_path_prefix_bypasses_refused(path, detail):
    refused(search(path=path), "path", detail)


def test_path_prefix_non_string_refused():
    refused(search(path=["/workspace/a"]), "path", "type")
    refused(search(path=None), "path", "type")


def test_canon_tool_path_is_identity_on_plain_paths():
    assert canon_tool_path("/a/b/") == "/a/b/"
    with pytest.raises(PathRefused):
        canon_tool_path(b"/a")


def test_local_server_prefix_without_trailing_slash():
    assert call(P, "read_file", {"path": "/workspace/x"}, server="localfs").allowed
    assert call(P, "read_file", {"path": "/workspaces/x"}, server="localfs").detail == "path_prefix"
    assert call(P, "read_file", {}, server="localfs").detail == "missing"


# --- pattern / string ---------------------------------------------------------------------------------


def test_pattern_fullmatch_and_anchors():
    assert search(query="open tickets").allowed
    refused(search(query="open tickets\n"), "query", "pattern")  # '$' would accept a trailing newline
    refused(search(query="open; drop"), "query", "pattern")
    refused(search(query="Open"), "query", "pattern")
    refused(search(query=""), "query", "pattern")


def test_pattern_without_anchors_is_still_whole_value():
    p = policy(POLICY_ONE_ARG % '{pattern: "[a-z]+"}')
    assert call(p, "t", {"a": "abc"}, server="s").allowed
    assert call(p, "t", {"a": "abc/../x"}, server="s").detail == "pattern"
    assert call(p, "t", {"a": "x" * 9000}, server="s").detail == "pattern"  # bounded regex input


def test_max_length_counts_code_points_and_needs_a_string():
    p = policy(POLICY_ONE_ARG % "{max_length: 3}")
    assert call(p, "t", {"a": "été"}, server="s").allowed
    assert call(p, "t", {"a": "abcd"}, server="s").detail == "max_length"
    assert call(p, "t", {"a": 12345}, server="s").detail == "type"


# --- numbers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 50, 25])
def test_integer_positive_controls(limit):
    assert search(limit=limit).allowed


@pytest.mark.parametrize(("limit", "detail"), [
    (True, "type"), (False, "type"),  # bool is not an integer (True == 1 in Python)
    (10.0, "type"), ("10", "type"), (None, "type"),
    (0, "min"), (51, "max"), (-(10**400), "min"), (10**400, "max"),
])
def test_integer_refusals(limit, detail):
    refused(search(limit=limit), "limit", detail)


def test_huge_and_non_finite_numbers():
    assert search(ratio=0.5).allowed and search(ratio=1).allowed
    refused(search(ratio=float("inf")), "ratio", "type")
    refused(search(ratio=float("nan")), "ratio", "type")
    refused(search(ratio=1e308), "ratio", "max")
    refused(search(ratio=True), "ratio", "type")
    refused(call(P, "search_tickets", '{"project": "acme", "ratio": 1e999}'), "ratio", "type")  # inf from JSON


def test_min_max_without_type_still_refuse_bool_and_strings():
    p = policy(POLICY_ONE_ARG % "{min: 0, max: 1}")
    assert call(p, "t", {"a": 1}, server="s").allowed and call(p, "t", {"a": 0.5}, server="s").allowed
    for value in (True, "1", None, [1]):
        assert call(p, "t", {"a": value}, server="s").detail == "type"


def test_boolean_type():
    assert search(flag=False).allowed
    refused(search(flag=0), "flag", "type")
    refused(search(flag="true"), "flag", "type")


# --- enum ---------------------------------------------------------------------------------------------


def test_enum_strict_types():
    assert search(status="open").allowed
    for value in ("Open", "open ", ["open"], {"open": 1}, None, "opén"):
        refused(search(status=value), "status", "enum")
    p = policy(POLICY_ONE_ARG % "{enum: [1, true, null]}")
    assert call(p, "t", {"a": 1}, server="s").allowed and call(p, "t", {"a": True}, server="s").allowed
    assert call(p, "t", {"a": None}, server="s").allowed
    assert call(p, "t", {"a": 1.0}, server="s").detail == "enum"
    p2 = policy(POLICY_ONE_ARG % "{enum: [1]}")
    assert call(p2, "t", {"a": True}, server="s").detail == "enum"  # True == 1 in Python, not in JSON


# --- equals_label (cross-tenant identifiers) -----------------------------------------------------------


def test_equals_label():
    assert search().allowed
    refused(search(project="globex"), "project", "label_mismatch")
    refused(search(project="ACME"), "project", "label_mismatch")
    refused(search(project="acme\u200b"), "project", "label_mismatch")
    refused(call(P, "search_tickets", {}, ), "project", "missing")
    refused(call(P, "search_tickets", {"project": "acme"}, labels={}), "project", "label_missing")
    refused(call(P, "search_tickets", {"project": ""}, labels={"tenant": ""}), "project", "label_missing")
    refused(search(project=["acme"]), "project", "type")


# --- unlisted arguments -------------------------------------------------------------------------------


def test_unlisted_arguments_denied_by_default():
    refused(search(Project="globex"), "Project", "unlisted")  # case variant of a listed name
    refused(search(**{"project\u200b": "globex"}), "<unlisted argument>", "unlisted")
    d = search(**{"evil name with spaces": 1})
    assert d.failed_argument == "<unlisted argument>"
    assert call(P, "wide_open", {"anything": 1, "else": [2]}).allowed  # unlisted_arguments: allow


def test_arguments_must_be_an_object():
    d = call(P, "search_tickets", ["acme"])
    assert d.reason is Reason.MCP_ARGUMENT_DENIED and d.detail == "not_object"


def test_message_never_contains_the_value():
    secret = "sk-live-0123456789abcdef"
    d = search(query=secret)
    assert secret not in d.message and "query" in d.message


# --- allowed_by_network -------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "https://docs.allowed.test/guide", "https://docs.allowed.test", "docs.allowed.test",
    "https://DOCS.allowed.test:443/a/../guide", "https://x.wild.test/",
])
def test_allowed_by_network_positive_controls(url):
    assert search(url=url).allowed


@pytest.mark.parametrize(("url", "detail"), [
    ("http://169.254.169.254/latest/meta-data/", "network:metadata_endpoint"),
    ("https://metadata.google.internal/", "network:metadata_endpoint"),
    ("https://[fd00:ec2::254]/", "network:metadata_endpoint"),
    ("https://10.0.0.1/", "network:address_forbidden"),
    ("https://127.0.0.1/", "network:address_forbidden"),
    ("https://2130706433/", "network:address_forbidden"),  # decimal 127.0.0.1
    ("https://0x7f.1/", "network:address_forbidden"),
    ("https://[::ffff:10.0.0.1]/", "network:address_forbidden"),  # IPv6-mapped private
    ("https://[::ffff:169.254.169.254]/", "network:metadata_endpoint"),
    ("https://evil.example/", "network:host_not_allowed"),
    ("https://evil.wild.test/", "network:host_not_allowed"),  # except_hosts
    ("https://docs.allowed.test/private/keys", "network:denied_by_rule"),  # deny wins
    ("https://docs.allowed.test:8443/", "network:port_not_allowed"),
    ("http://docs.allowed.test/", "network:scheme_not_allowed"),
    ("https://user@docs.allowed.test/", "network:bad_url:userinfo"),
    ("file:///etc/passwd", "network:bad_url:bad_url"),
    ("gopher://docs.allowed.test/", "network:bad_url:bad_url"),
    ("https://docs.allowed.test\\@evil.example/", "network:bad_url:userinfo"),
    ("https://evil.example#@docs.allowed.test", "network:bad_url:fragment"),
    ("//docs.allowed.test/x", "network:bad_url:bad_char"),
    ("docs.allowed.test:443", "network:bad_url:port_in_host"),
    ("https://docs.allowed.test%2f@evil.example/", "network:bad_url:userinfo"),
])
def test_allowed_by_network_refusals(url, detail):
    refused(search(url=url), "url", detail)


def test_allowed_by_network_uses_the_sandbox_conditions():
    gold = "      - host: s.test\n      - host: t.test\n        when: {labels: {tier: gold}}\n"
    p = policy(POLICY_ONE_ARG.replace("      - host: s.test\n", gold) % "{allowed_by_network: true}")
    assert call(p, "t", {"a": "https://t.test/"}, server="s", labels={"tier": "gold"}).allowed
    assert call(p, "t", {"a": "https://t.test/"}, server="s", labels={"tier": "free"}).detail == \
        "network:condition_failed"


POLICY_ONE_ARG = """
sandbox: {name: one}
network:
  https:
    allow:
      - host: s.test
mcp:
  servers:
    - name: s
      url: https://s.test/mcp
      tools:
        allow:
          - name: t
            arguments:
              a: %s
"""


def test_type_integer_alone_refuses_bool():
    p = policy(POLICY_ONE_ARG % "{type: integer}")
    assert call(p, "t", {"a": 10**30}, server="s").allowed
    for value in (True, False, 1.0, "1"):
        assert call(p, "t", {"a": value}, server="s").detail == "type"


def test_url_argument_length_is_bounded():
    refused(search(url="https://docs.allowed.test/" + "a" * 9000), "url", "network:bad_url:too_long")


def test_required_argument_missing_is_refused_and_present_passes():
    """`required: true` (project): a call without it is refused as `missing`; with it, allowed; an
    argument that is not required (limit) may be left out."""
    refused(call(P, "search_tickets", {"limit": 5}), "project", "missing")
    assert call(P, "search_tickets", {"project": "acme"}).allowed
