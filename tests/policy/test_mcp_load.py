"""Loading the `mcp` section: every mistake is refused with the file and the key path of the culprit."""

from __future__ import annotations

import textwrap

import pytest

from egressgate.policy.errors import PolicyError
from egressgate.policy.loader import parse_policy
from tests.policy.mcp_support import policy

HEAD = """
sandbox: {name: t}
network:
  https:
    allow:
      - host: s.test
        paths: ["/mcp/**", "/mcp"]
      - host: s2.test
mcp:
"""


def problems(mcp: str) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        parse_policy(HEAD + textwrap.indent(textwrap.dedent(mcp), "  "), "m.yaml")
    assert str(info.value).startswith("m.yaml: ")
    return info.value.problems


def one(mcp: str) -> tuple[str, str]:
    found = problems(mcp)
    assert len(found) == 1, found
    return found[0]


def test_full_example_loads():
    p = policy()
    assert set(p.mcp.servers) == {"tickets", "legacy", "localfs"}
    assert p.mcp.servers["tickets"].url == "https://tickets.mcp.test:443/mcp"
    assert p.mcp.servers["legacy"].transport == "sse" and p.mcp.servers["localfs"].transport is None
    assert p.mcp.max_message_bytes == 1048576 and p.mcp.record_arguments is False


def test_unknown_keys_name_the_path():
    assert one("servers: [{name: a, url: 'https://s.test/mcp', tols: {}}]")[0] == "mcp.servers[0].tols"
    path, message = one("""
        servers:
          - name: a
            url: https://s.test/mcp
            tools: {allow: [{name: t, arguments: {x: {min: 1, maxx: 2}}}]}
    """)
    assert path == "mcp.servers[0].tools.allow[0].arguments.x.maxx" and "unknown key" in message
    assert one("recordarguments: true")[0] == "mcp.recordarguments"


def test_bad_regex():
    path, message = one("""
        servers:
          - name: a
            url: https://s.test/mcp
            tools: {allow: [{name: t, arguments: {q: {pattern: "([a-z]"}}}]}
    """)
    assert path == "mcp.servers[0].tools.allow[0].arguments.q.pattern" and "regular expression" in message


def test_duplicate_server_names():
    path, message = one("""
        servers:
          - {name: a, url: "https://s.test/mcp"}
          - {name: a, url: "https://s2.test/mcp"}
    """)
    assert path == "mcp.servers[1].name" and "mcp.servers[0]" in message


def test_duplicate_urls_after_canonicalization():
    path, _ = one("""
        servers:
          - {name: a, url: "https://s.test/mcp"}
          - {name: b, url: "https://S.TEST:443/x/../mcp"}
    """)
    assert path == "mcp.servers[1].url"


@pytest.mark.parametrize("server", [
    "{name: a, url: 'https://s.test/mcp', local: true}",
    "{name: a}",
    "{name: a, local: false}",
])
def test_url_and_local_exactly_one(server):
    path, message = one(f"servers: [{server}]")
    assert path == "mcp.servers[0]" and "exactly one" in message


def test_local_with_transport():
    assert one("servers: [{name: a, local: true, transport: sse}]")[0] == "mcp.servers[0].transport"


@pytest.mark.parametrize(("url", "fragment"), [
    ("https://other.test/mcp", "no network.https allow rule"),
    ("https://s.test/elsewhere", "no network.https allow rule"),  # path outside the rule's paths
    ("https://s.test:8443/mcp", "no network.https allow rule"),
    ("http://s.test/mcp", "no network.http allow rule"),
    ("https://s.test/mcp?x=1", "query"),
    ("ftp://s.test/mcp", "not a usable URL"),
    ("https://user@s.test/mcp", "not a usable URL"),
])
def test_url_must_be_reachable_through_a_network_rule(url, fragment):
    path, message = one(f"servers: [{{name: a, url: '{url}'}}]")
    assert path == "mcp.servers[0].url" and fragment in message


@pytest.mark.parametrize(("name", "ok"), [("tickets", True), ("a_b-1", True), ("A", False), ("-a", False),
                                          ("a" * 65, False), ("a.b", False)])
def test_server_name_shape(name, ok):
    text = f"servers: [{{name: '{name}', local: true}}]"
    if ok:
        parse_policy(HEAD + "  " + text + "\n", "m.yaml")
    else:
        assert one(text)[0] == "mcp.servers[0].name"


@pytest.mark.parametrize(("constraint", "key"), [
    ("{type: integer, pattern: 'a'}", "pattern"),
    ("{type: string, min: 1}", "min"),
    ("{min: 5, max: 1}", "min"),
    ("{enum: []}", "enum"),
    ("{path_prefix: relative/dir}", "path_prefix"),
    ("{path_prefix: /a/../b}", "path_prefix"),
    ("{max_length: -1}", "max_length"),
    ("{type: int}", "type"),
    ("{required: 'true'}", "required"),
    ("{min: .inf}", "min"),
])
def test_bad_constraints(constraint, key):
    found = problems(f"""
        servers:
          - name: a
            url: https://s.test/mcp
            tools: {{allow: [{{name: t, arguments: {{x: {constraint}}}}}]}}
    """)
    assert found[0][0].startswith("mcp.servers[0].tools.allow[0].arguments.x"), found
    assert key in found[0][0] or key in found[0][1], found


def test_duplicate_tool_and_rule_ids():
    path, _ = one("""
        servers:
          - name: a
            url: https://s.test/mcp
            tools: {allow: [{name: t}, {name: t}]}
    """)
    assert path == "mcp.servers[0].tools.allow[1].name"
    path, message = one("""
        servers:
          - name: a
            url: https://s.test/mcp
            tools: {allow: [{name: t, id: same}, {name: u, id: same}]}
    """)
    assert path == "mcp.servers[0].tools.allow[1].id" and "duplicate rule id" in message


def test_pin_for_unlisted_tool_and_bad_hash():
    path, _ = one(f"""
        servers:
          - name: a
            url: https://s.test/mcp
            tool_schemas: {{typo: "{"0" * 64}"}}
            tools: {{allow: [{{name: t}}]}}
    """)
    assert path == "mcp.servers[0].tool_schemas.typo"
    path, _ = one("""
        servers:
          - name: a
            url: https://s.test/mcp
            tool_schemas: {t: "ABC"}
            tools: {allow: [{name: t}]}
    """)
    assert path == "mcp.servers[0].tool_schemas.t"


def test_max_message_bytes_bounds():
    assert one("max_message_bytes: 0")[0] == "mcp.max_message_bytes"
    assert one("max_message_bytes: 1000000000")[0] == "mcp.max_message_bytes"


def test_tool_name_shape():
    path, _ = one("""
        servers:
          - name: a
            url: https://s.test/mcp
            tools: {deny: ["bad name"]}
    """)
    assert path == "mcp.servers[0].tools.deny[0]"


def test_docs_example_loads_and_decides():
    """The example in docs/policy.md ("MCP tool calls") is a policy that loads and means what it says."""
    from pathlib import Path

    from egressgate.policy.reasons import Reason
    from tests.policy.mcp_support import call

    doc = (Path(__file__).resolve().parents[2] / "docs" / "policy.md").read_text()
    block = doc.split("## MCP tool calls (`mcp`)", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    block = "\n".join(line for line in block.splitlines() if "credential:" not in line)  # no capability here
    p = parse_policy("sandbox: {name: doc}\n" + block, "doc.yaml")
    assert set(p.mcp.servers) == {"tickets", "files"}
    ok = {"project": "acme", "limit": 5, "path": "/workspace/a", "url": "https://tickets.mcp.test/mcp"}
    pin = p.mcp.servers["tickets"].tool_schemas["search_tickets"]
    d = call(p, "search_tickets", ok, tool_schema_now=pin, server_info_now=("tickets-server", "1.4.2"))
    assert d.reason is Reason.APPROVAL_REQUIRED  # everything holds; the tool needs an operator's approval


def test_network_rule_ids_cannot_take_mcp_counter_keys():
    """`mcp:<server>` is the server's call counter in the state store: a network rule with that id would
    share (and spend) it."""
    text = HEAD.replace("      - host: s2.test\n", "      - host: s2.test\n        id: \"mcp:a\"\n")
    with pytest.raises(PolicyError) as info:
        parse_policy(text + "  servers: [{name: a, url: 'https://s.test/mcp'}]\n", "m.yaml")
    assert info.value.problems == [("network.https.allow[1].id", "ids starting with 'mcp:' are reserved for MCP "
                                                                 "call budgets")]
