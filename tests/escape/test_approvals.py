"""An operator's approval widens the allowlist of one sandbox, never the address checks.

Each name below is outside escape-approval's allowlist, so the first request is refused
`approval_required`; the operator approves it (the real `egressgate approvals approve` CLI, in the
gateway namespace); the retry must still be refused for the address the name resolves to (metadata
canary, loopback, private, CGNAT, WireServer, IPv4-in-IPv6), and no canary may see a connection.
Positive control: the same steps for other.allowed.test (a good address) reach the upstream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

import tests.networld as nw
from tests.escape.checks import ADDRESS_REASONS, assert_denied, assert_untouched, deny_reason, requests_on
from tests.networld import World
from tests.support.launcher import EGRESSGATE, audit_records, labels_of
from tests.support.netgateway import Curl, Gateway, Sandbox
from tests.support.transparent import Transparent
from tests.support.waiting import wait_for

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


@pytest.fixture(scope="module")
def unoffered_sbx(gateway: Gateway) -> Sandbox:
    """One escape-approval sandbox for every never-offered literal: none of them creates an approval (each
    case asserts it), so nothing one case does can change another's answer; a fresh sandbox per case was
    one `sandbox admit` CLI run each."""
    gateway.sandboxes.pop("escape-approval", None)
    return gateway.admit("escape-approval")


@pytest.mark.parametrize("literal", NEVER_OFFERED)
def test_forbidden_literals_are_never_offered_for_approval(world: World, gateway: Gateway, unoffered_sbx: Sandbox,
                                                           literal: str) -> None:
    mark = world.mark()
    res = gateway.curl(unoffered_sbx, f"http://{literal}/")
    assert_denied(res, ADDRESS_REASONS)
    assert "approval_id" not in res.deny_body()
    assert_untouched(world, mark, literal)


def test_an_approved_rebinding_name_is_pinned_per_connection(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    """rebind.evil.test answers the upstream, then 169.254.169.254, in turn: each request is checked and
    dialed on the address it resolved to, so an approval never turns a rebind into a canary hit."""
    mark = world.mark()
    cli_approve(world, gateway, approval_id(gateway.curl(sbx, "http://rebind.evil.test/r")))
    outcomes = []
    for _ in range(4):
        res = gateway.curl(sbx, "http://rebind.evil.test/r")
        outcomes.append("allowed" if res.status == 200 and not res.denied
                        else assert_denied(res, ADDRESS_REASONS))
    assert "allowed" in outcomes and set(outcomes) - {"allowed"}, outcomes  # both answers were seen
    assert_untouched(world, mark, "rebind.evil.test")


TNET = "198.18.14"  # this module's transparent namespace (other modules use .5/.6/.7/.9/.12/.13)


@pytest.fixture(scope="module")
def tsb(world: World, gateway: Gateway) -> Iterator[Transparent]:
    t = Transparent.create(world, gateway, tag="tap", net=TNET, table="egA_tapprove")
    try:
        yield t
    finally:
        t.close()


def test_transparent_requests_ask_and_an_approval_never_lifts_the_address_check(
        world: World, gateway: Gateway, tsb: Transparent) -> None:
    """The same on the transparent listener (what `sandbox run` uses): the name comes from the Host
    header, the address the sandbox dialed is never used; an approved good name is reached, an approved
    name resolving to the metadata canary is not."""
    source = f"{TNET}.3"
    gateway.sandboxes.pop(f"escape-approval@{source}", None)
    gateway.admit("escape-approval", address=source)
    mark = world.mark()
    asked = tsb.http(nw.UPSTREAM, "other.allowed.test", path="/transparent", source=source)
    assert deny_reason(asked) == "approval_required"
    cli_approve(world, gateway, asked.json()["approval_id"])
    allowed = tsb.http(nw.UPSTREAM, "other.allowed.test", path="/transparent", source=source)
    assert allowed.status == 200 and not allowed.denied, allowed
    assert [h["target"] for h in requests_on(world, mark, "upstream-http")] == ["/transparent"]
    meta = tsb.http(nw.UPSTREAM, "metadata.evil.test", path="/latest/meta-data/", source=source)
    assert deny_reason(meta) == "approval_required"
    cli_approve(world, gateway, meta.json()["approval_id"])
    again = tsb.http(nw.UPSTREAM, "metadata.evil.test", path="/latest/meta-data/", source=source)
    assert deny_reason(again) in ADDRESS_REASONS
    assert_untouched(world, mark, "metadata.evil.test (transparent)")


def admit_labelled(world: World, gateway: Gateway, labels: dict[str, str], address: str | None = None) -> Sandbox:
    """`egressgate sandbox admit --label k=v ...` (and `--address` for the transparent listener)."""
    extra = [arg for k, v in labels.items() for arg in ("--label", f"{k}={v}")]
    if address is not None:
        extra += ["--address", address]
    res = world.exec(world.gw, EGRESSGATE, "sandbox", "admit", "--config", str(gateway.config),
                     "--policy", "escape-approval", *extra)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    return Sandbox(id=data["id"], token=data["token"], proxy_url=data["proxy_url"], policy="escape-approval",
                   env=data.get("env", {}))


def approval_records(gateway: Gateway, approval: str, n: int) -> list[dict]:
    """The `approval` records of one approval once `n` are written (`requested` is written behind)."""
    def found() -> list[dict]:
        return [r for r in audit_records(gateway.tmp / "var" / "audit.jsonl")
                if r.get("egressgate.operation") == "approval" and r.get("egressgate.approval.id") == approval]

    assert wait_for(lambda: len(found()) >= n), f"fewer than {n} approval records for {approval}: {found()}"
    return found()


def test_explicit_and_transparent_settle_approvals_with_the_same_labels(
        world: World, gateway: Gateway, tsb: Transparent) -> None:
    """Both paths decide and settle an approval on the sandbox's identity facts, labels included. The
    same label-conditioned policy gives the same answers through the explicit proxy and the transparent
    listener: tier=locked is refused by the `when: labels` deny rule before and after any approval (none
    is offered), tier=open waits for an approval and is reached after it (the positive control: the
    upstream sees exactly the two approved requests). Every approval record names the sandbox's labels."""
    opened = {"tier": "open", "team": "t1"}
    explicit = {"open": admit_labelled(world, gateway, opened),
                "locked": admit_labelled(world, gateway, {"tier": "locked"})}
    sources = {"open": f"{TNET}.4", "locked": f"{TNET}.5"}
    for tier, source in sources.items():
        admit_labelled(world, gateway, opened if tier == "open" else {"tier": "locked"}, source)

    def via_proxy(tier: str):
        return gateway.curl(explicit[tier], "http://other.allowed.test/labelled")

    def via_transparent(tier: str):
        return tsb.http(nw.UPSTREAM, "other.allowed.test", path="/labelled", source=sources[tier])

    def outcome(res) -> str:
        return "allowed" if res.status == 200 and not res.denied else deny_reason(res)

    def body(res) -> dict:
        return res.deny_body() if hasattr(res, "deny_body") else res.json()

    mark = world.mark()
    seen: dict[str, list[str]] = {}
    approvals: dict[str, str] = {}
    for path, fetch in (("explicit", via_proxy), ("transparent", via_transparent)):
        first_open, first_locked = fetch("open"), fetch("locked")
        assert body(first_locked)["rule"] == "locked-tier" and "approval_id" not in body(first_locked)
        approvals[path] = body(first_open)["approval_id"]
        cli_approve(world, gateway, approvals[path])
        seen[path] = [outcome(first_open), outcome(first_locked), outcome(fetch("open")), outcome(fetch("locked"))]
    assert seen["explicit"] == seen["transparent"] == [
        "approval_required", "denied_by_rule", "allowed", "denied_by_rule"], seen
    assert approvals["explicit"] != approvals["transparent"]  # two sandboxes, two approvals
    assert [h["target"] for h in requests_on(world, mark, "upstream-http")] == ["/labelled", "/labelled"]
    for path, approval in approvals.items():
        steps = approval_records(gateway, approval, 2)
        assert [(r["egressgate.approval.action"], labels_of(r)) for r in steps] == [
            ("requested", opened), ("approved", opened)], (path, steps)
