"""decide_tool_call / visible_tools / mcp_server_for: tool-level decisions, pins, budgets, approvals."""

from __future__ import annotations

import pytest

from egressgate.approvals.grant import SCOPE_HOST_PATH, Grant
from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.mcp_decide import (
    MCP_GRANT_METHOD,
    MCP_GRANT_PORT,
    MCP_GRANT_SCHEME,
    decide_local_start,
    local_server,
    mcp_server_for,
    visible_tools,
)
from egressgate.policy.reasons import Reason
from egressgate.policy.target import parse_target
from tests.policy.mcp_support import PIN, POLICY, call, policy

P = policy()


def test_allowed_tool_positive_control():
    d = call(P, "search_tickets", {"project": "acme", "limit": 10, "status": "open"})
    assert d.allowed and d.reason is Reason.RULE_MATCHED and d.rule_id == "tickets-search"
    assert d.budget_keys == (("mcp:tickets", 5), ("mcp:tickets/search_tickets", 3))
    assert d.message == "" and d.failed_argument is None


def test_default_rule_id_and_no_budget_keys():
    d = call(P, "wide_open", {"anything": [1, {"x": None}]})
    assert d.allowed and d.rule_id == "mcp:tickets/wide_open"
    assert d.budget_keys == (("mcp:tickets", 5),)


def test_default_deny_unlisted_tool():
    d = call(P, "drop_database", {})
    assert not d.allowed and d.reason is Reason.MCP_TOOL_DENIED and d.rule_id is None
    assert d.detail == "not_allowed" and "tools/list" in d.message and d.budget_keys == ()


def test_deny_wins_over_allow():
    d = call(P, "delete_ticket", {})
    assert d.reason is Reason.MCP_TOOL_DENIED and d.rule_id == "mcp:tickets/deny[0]"
    assert "denied by rule" in d.message
    assert call(P, "purge", {}).rule_id == "mcp:tickets/deny[1]"


def test_unknown_server_denied():
    d = call(P, "search_tickets", server="nope")
    assert d.reason is Reason.MCP_TOOL_DENIED and d.detail == "unknown_server"


@pytest.mark.parametrize("raw", [
    '"search\\u005ftickets"',  # escaped underscore: decodes to the allowed name, which the server sees too
    '"\\u0073earch_tickets"',
])
def test_unicode_escaped_tool_names_decode_before_matching(raw):
    import json
    assert call(P, json.loads(raw)).allowed
    # ... and an escaped spelling of a denied tool is denied by its deny rule, not merely by default
    assert call(P, json.loads('"delete\\u005fticket"'), {}).rule_id == "mcp:tickets/deny[0]"


@pytest.mark.parametrize("name", [
    "Search_tickets", "search_tickets ", "search_tickets\u200b", "\uff53earch_tickets", "search\u2011tickets",
    "search_tickets\x00", "search_ticket", "",
])
def test_look_alike_tool_names_are_not_listed(name):
    d = call(P, name)
    assert not d.allowed and d.reason is Reason.MCP_TOOL_DENIED and d.detail == "not_allowed"
    assert "\x00" not in d.message and "\u200b" not in d.message


@pytest.mark.parametrize("name", [["search_tickets"], None, 7, {"name": "search_tickets"}])
def test_non_string_tool_names_are_denied(name):
    d = call(P, name)
    assert d.reason is Reason.MCP_TOOL_DENIED and d.detail == "not_allowed"


def test_long_tool_name_is_echoed_bounded():
    d = call(P, "x" * 10000)
    assert len(d.message) < 300 and "..." in d.message


def test_budgets_server_then_tool():
    assert call(P, "search_tickets", tool_calls=2, server_calls=4).allowed
    d = call(P, "search_tickets", tool_calls=3)
    assert d.reason is Reason.BUDGET_EXCEEDED and d.detail == "mcp:tickets/search_tickets"
    d = call(P, "wide_open", {}, server_calls=5)
    assert d.reason is Reason.BUDGET_EXCEEDED and d.detail == "mcp:tickets" and "spent" in d.message


def _grant(**kw) -> Grant:
    base = dict(id="apr-0123456789abcdef", sandbox_id="sb-1", scope=SCOPE_HOST_PATH, scheme=MCP_GRANT_SCHEME,
                host="tickets", port=MCP_GRANT_PORT, method=MCP_GRANT_METHOD, path="escalate", expires_at=2000.0)
    base.update(kw)
    return Grant(**base)


def test_approval_required_then_granted():
    d = call(P, "escalate", {})
    assert d.reason is Reason.APPROVAL_REQUIRED and d.approval_kind == "mcp_tool" and not d.allowed
    d = call(P, "escalate", {}, grants=(_grant(),))
    assert d.allowed and d.reason is Reason.APPROVAL_GRANTED and d.approval_id == "apr-0123456789abcdef"


@pytest.mark.parametrize("bad", [
    {"expires_at": 1000.0},  # expired at `now`
    {"sandbox_id": "sb-2"},  # another sandbox's approval
    {"path": "search_tickets"},  # another tool
    {"host": "legacy"},  # another server
    {"scheme": "https"},  # a network grant
    {"port": 443},
])
def test_approval_grant_must_match_exactly(bad):
    assert call(P, "escalate", {}, grants=(_grant(**bad),)).reason is Reason.APPROVAL_REQUIRED


def test_mcp_grant_never_covers_network_requests():
    """The stored shape of a tool approval cannot widen the network allowlist (port 0, scheme mcp)."""
    expanding = policy(POLICY.replace("sandbox:\n  name: mcp-t\n",
                                      "sandbox:\n  name: mcp-t\nexecution:\n  require_approval_for: "
                                      "[network_expansion]\n"))
    facts = parse_target("POST https://tickets/escalate")
    state = SandboxState("sb-1", 0.0, approvals=(_grant(),))
    assert decide(expanding, facts, state, 1000.0).reason is Reason.APPROVAL_REQUIRED
    network_grant = _grant(scheme="https", port=443, method="POST", path="/escalate")  # positive control
    state = SandboxState("sb-1", 0.0, approvals=(network_grant,))
    assert decide(expanding, facts, state, 1000.0).reason is Reason.APPROVAL_GRANTED


def test_server_info_pin():
    ok = ("legacy-server", "1.4.2")
    assert call(P, "unpinned", {}, server="legacy", server_info_now=ok).allowed
    d = call(P, "unpinned", {}, server="legacy", server_info_now=("legacy-server", "1.4.3"))
    assert d.reason is Reason.MCP_SERVER_CHANGED and d.detail == "server_info_pin"
    d = call(P, "unpinned", {}, server="legacy", server_info_now=None)
    assert d.reason is Reason.MCP_SERVER_CHANGED and d.detail == "server_info_unseen"


def test_tool_schema_pin():
    ok = ("legacy-server", "1.4.2")
    assert call(P, "lookup", {}, server="legacy", server_info_now=ok, tool_schema_now=PIN).allowed
    d = call(P, "lookup", {}, server="legacy", server_info_now=ok, tool_schema_now="b" * 64)
    assert d.reason is Reason.MCP_SCHEMA_DRIFT and d.detail == "tool_schema_pin"
    d = call(P, "lookup", {}, server="legacy", server_info_now=ok)
    assert d.reason is Reason.MCP_SCHEMA_DRIFT and d.detail == "tool_schema_unseen" and "tools/list" in d.message
    # trust_on_first_use: false and no pin for `unpinned`: a changed schema is not checked
    assert call(P, "unpinned", {}, server="legacy", server_info_now=ok, tool_schema_now="c" * 64,
                tool_schema_seen="d" * 64).allowed


def test_trust_on_first_use():
    assert call(P, "wide_open", {}, tool_schema_seen="a" * 64, tool_schema_now="a" * 64,
                server_info_seen=("s", "1"), server_info_now=("s", "1")).allowed
    assert call(P, "wide_open", {}, tool_schema_seen=None, tool_schema_now="a" * 64).allowed  # first sight
    d = call(P, "wide_open", {}, tool_schema_seen="a" * 64, tool_schema_now="b" * 64)
    assert d.reason is Reason.MCP_SCHEMA_DRIFT and d.detail == "tool_schema_tofu" and d.rule_id
    d = call(P, "wide_open", {}, server_info_seen=("s", "1"), server_info_now=("s", "2"))
    assert d.reason is Reason.MCP_SERVER_CHANGED and d.detail == "server_info_tofu"


def test_checks_order_deny_before_budget_and_approval():
    assert call(P, "delete_ticket", {}, server_calls=99).reason is Reason.MCP_TOOL_DENIED
    d = call(P, "search_tickets", {"project": "other"}, tool_calls=99)
    assert d.reason is Reason.MCP_ARGUMENT_DENIED  # a refused call is never "budget" nor sent to an approver


def test_visible_tools_filters_to_allowed():
    tools = [{"name": n, "description": "d"} for n in
             ("search_tickets", "delete_ticket", "purge", "secret_tool", "wide_open")]
    tools += [{"name": 7}, "junk", {"description": "no name"}]
    shown = [t["name"] for t in visible_tools(P, "tickets", tools)]
    assert shown == ["search_tickets", "wide_open"]
    assert [t["name"] for t in visible_tools(P, "tickets", tools, drifted=frozenset({"wide_open"}))] == \
        ["search_tickets"]
    assert visible_tools(P, "nope", tools) == []


def test_visible_tools_drops_duplicated_names():
    tools = [{"name": "search_tickets", "description": "benign"}, {"name": "search_tickets", "description": "x"},
             {"name": "wide_open"}]
    assert [t["name"] for t in visible_tools(P, "tickets", tools)] == ["wide_open"]


def test_mcp_server_for_routes():
    assert mcp_server_for(P, "https", "tickets.mcp.test", 443, "/mcp").name == "tickets"
    assert mcp_server_for(P, "https", "tickets.mcp.test", 443, "/mcp/").name == "tickets"
    assert mcp_server_for(P, "https", "tickets.mcp.test", 443, "/mcp/x").name == "tickets"
    assert mcp_server_for(P, "https", "tickets.mcp.test", 443, "/mcpx") is None
    assert mcp_server_for(P, "https", "tickets.mcp.test", 8443, "/mcp") is None
    assert mcp_server_for(P, "http", "tickets.mcp.test", 443, "/mcp") is None
    # every spelling a server may read as the endpoint is the MCP route too (parsed strictly, decided)
    for variant in ("//mcp", "/mcp//", "/MCP", "/Mcp/x", "/mcp;jsessionid=1", "/mcp.json", "/%2Fmcp",
                    "/mcp%2F", "/%EF%BD%8Dcp", "/mcp::$DATA", "/MCP~1"):
        assert mcp_server_for(P, "https", "tickets.mcp.test", 443, variant) is not None, variant
    for other in ("/mcpx", "/other", "/mc", "/"):  # positive controls: other paths stay plain requests
        assert mcp_server_for(P, "https", "tickets.mcp.test", 443, other) is None, other
    # SSE: the message endpoint is chosen by the server, so the whole origin is the MCP route
    assert mcp_server_for(P, "https", "legacy.mcp.test", 443, "/messages/").name == "legacy"
    assert mcp_server_for(P, "https", "docs.allowed.test", 443, "/") is None


def test_decide_local_start():
    d = decide_local_start(P, "localfs")  # the test policy leaves execution.local_mcp_servers at deny
    assert d.reason is Reason.MCP_LOCAL_DENIED and d.detail == "execution_denied" and "local_mcp_servers" in d.message
    allowing = policy(POLICY.replace("sandbox:\n  name: mcp-t\n",
                                     "sandbox:\n  name: mcp-t\nexecution:\n  local_mcp_servers: allow\n"))
    assert decide_local_start(allowing, "localfs").allowed
    for name in ("tickets", "nope"):  # a remote server or an unknown name never starts locally
        d = decide_local_start(allowing, name)
        assert d.reason is Reason.MCP_LOCAL_DENIED and d.detail == "not_local" and "local: true" in d.message


def test_local_server():
    assert local_server(P, "localfs").name == "localfs"
    assert local_server(P, "tickets") is None and local_server(P, "nope") is None


def test_policy_without_mcp_keeps_its_hash():
    from egressgate.policy.loader import parse_policy
    plain = "sandbox: {name: x}\n"
    a = parse_policy(plain, "a.yaml").hash
    assert a == parse_policy(plain + "mcp: {}\n", "a.yaml").hash
    assert a != parse_policy(plain + "mcp: {record_arguments: true}\n", "a.yaml").hash
    # the hash of a policy with no mcp section, as computed before the section existed
    assert a == "sha256:" + __import__("hashlib").sha256(
        __import__("json").dumps(
            {k: v for k, v in parse_policy(plain, "a.yaml").model.model_dump(mode="json").items()
             if k not in ("mcp", "persistence")},  # neither section existed then
            sort_keys=True, separators=(",", ":")).encode()).hexdigest()
