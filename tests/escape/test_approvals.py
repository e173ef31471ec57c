"""An operator's approval widens the allowlist of one sandbox, never the address checks.

Each name below is outside escape-approval's allowlist, so the first request is refused
`approval_required`; the operator approves it (the real `egressgate approvals approve` CLI, in the
gateway namespace); the retry must still be refused for the address the name resolves to (metadata
canary, loopback, private, CGNAT, WireServer, IPv4-in-IPv6), and no canary may see a connection.
Positive control: the same steps for other.allowed.test (a good address) reach the upstream.
"""

from __future__ import annotations

import json

import pytest

from tests.escape.checks import ADDRESS_REASONS, assert_denied, assert_untouched, requests_on
from tests.networld import World
from tests.support.launcher import EGRESSGATE
from tests.support.netgateway import Curl, Gateway, Sandbox

pytestmark = pytest.mark.netns

FORBIDDEN_NAMES = ["metadata.evil.test", "loopback.evil.test", "private.evil.test", "cgnat.evil.test",
                   "wireserver.evil.test", "mapped.evil.test", "v6meta.evil.test", "nat64.evil.test",
                   "mixed.evil.test"]
# refused before any approval is offered: metadata host names and forbidden IP literals in any spelling
NEVER_OFFERED = ["metadata.google.internal", "METADATA.google.internal.", "169.254.169.254", "2852039166",
                 "0251.0376.0251.0376", "[::ffff:a9fe:a9fe]", "127.1", "0x7f.1",
                 "10.0.0.5", "[::1]", "[64:ff9b::a9fe:a9fe]"]


def approval_id(res: Curl) -> str:
    assert_denied(res, {"approval_required"})
    # a refused CONNECT: curl drops the body; the audit record names the approval
    found = res.audit.get("egressgate.approval.id") if res.audit is not None else res.deny_body()["approval_id"]
    assert isinstance(found, str) and found.startswith("apr-"), res
    return found


def cli_approve(world: World, gateway: Gateway, approval: str) -> dict:
    res = world.exec(world.gw, EGRESSGATE, "approvals", "approve", approval, "--config", str(gateway.config),
                     "--for", "5m", "--by", "escape-test")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture
def sbx(gateway: Gateway) -> Sandbox:
    """A fresh sandbox per test (Gateway.admit caches per policy key; approvals are per sandbox)."""
    gateway.sandboxes.pop("escape-approval", None)
    return gateway.admit("escape-approval")


def test_positive_control_an_approved_good_name_is_reached(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    first = gateway.curl(sbx, "http://other.allowed.test/approved")
    granted = cli_approve(world, gateway, approval_id(first))
    assert (granted["state"], granted["decided_by"], granted["scope"]) == ("approved", "escape-test", "host")
    assert requests_on(world, mark, "upstream-http") == []  # nothing reached it before the approval
    res = gateway.curl(sbx, "http://other.allowed.test/approved")
    assert res.status == 200 and not res.denied, res
    assert [h["target"] for h in requests_on(world, mark, "upstream-http")] == ["/approved"]


@pytest.mark.parametrize("name", FORBIDDEN_NAMES)
def test_an_approved_name_still_fails_the_address_check(world: World, gateway: Gateway, sbx: Sandbox,
                                                        name: str) -> None:
    mark = world.mark()
    cli_approve(world, gateway, approval_id(gateway.curl(sbx, f"http://{name}/latest/meta-data/")))
    for _ in range(2):
        assert_denied(gateway.curl(sbx, f"http://{name}/latest/meta-data/"), ADDRESS_REASONS)
    assert_untouched(world, mark, name)


def test_an_approved_tunnel_to_a_metadata_name_is_refused(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    cli_approve(world, gateway, approval_id(gateway.curl(sbx, "https://metadata.evil.test/")))
    assert_denied(gateway.curl(sbx, "https://metadata.evil.test/"), ADDRESS_REASONS)
    assert_untouched(world, mark, "https://metadata.evil.test/")


@pytest.mark.parametrize("literal", NEVER_OFFERED)
def test_forbidden_literals_are_never_offered_for_approval(world: World, gateway: Gateway, sbx: Sandbox,
                                                           literal: str) -> None:
    mark = world.mark()
    res = gateway.curl(sbx, f"http://{literal}/")
    assert_denied(res, ADDRESS_REASONS)
    assert "approval_id" not in res.deny_body()
    assert_untouched(world, mark, literal)
