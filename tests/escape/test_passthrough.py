"""`tls: passthrough` routes in the closed network world: pinning, address checks and fronting still hold.

A passthrough tunnel is not intercepted, so the client verifies the *world's* CA (a gateway that
intercepted would fail that). Every forbidden destination is a canary in the world: the assertion is on
the receiving side (canary untouched, no fronted session on the allowed upstream). Positive controls:
the allowed name is spliced end to end, `forbidden.test` is a live listener that the allowed upstream's
certificate also names (so fronting would have worked), and on the transparent listener an ordinary rule's
name is still intercepted (gateway CA) while the passthrough rule's name is spliced (world CA).
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Iterator

import pytest

import tests.networld as nw
from tests.escape.checks import SETTLE, assert_untouched, requests_on
from tests.networld import World
from tests.support.http1 import read_response
from tests.support.launcher import complete_lines, flatten_otlp
from tests.support.netgateway import Gateway
from tests.support.transparent import UPSTREAM, Transparent

pytestmark = pytest.mark.netns

POLICY = "escape-passthrough"
NET = "198.18.9"
SOURCE = f"{NET}.6"  # the escape-passthrough sandbox's address on the transparent link


def world_tls(world: World, sock: socket.socket, sni: str) -> ssl.SSLSocket:
    """TLS trusting only the world's CA (names checked): only a spliced session verifies."""
    ctx = ssl.create_default_context(cafile=str(world.ca_pem))
    return ctx.wrap_socket(sock, server_hostname=sni)


def get(tls: ssl.SSLSocket, host: str, path: str) -> int:
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    return read_response(tls).status


def test_passthrough_splices_to_the_pinned_upstream(world: World, gateway: Gateway):
    sbx = gateway.admit(POLICY)
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "api.allowed.test:443")
    assert resp.status == 200, resp.raw[:300]
    with world_tls(world, sock, "api.allowed.test") as tls:
        assert get(tls, "api.allowed.test", "/passthrough") == 200
    [req] = requests_on(world, mark, "upstream-tls")
    assert (req["sni"], req["host"], req["target"]) == ("api.allowed.test", "api.allowed.test", "/passthrough")


@pytest.mark.parametrize("sni", ["forbidden.test", "other.allowed.test", "x.evil.test"])
def test_sni_fronting_through_a_passthrough_tunnel_is_refused(world: World, gateway: Gateway, sni: str):
    """The allowed upstream's certificate names every one of these: only the gateway stops the session."""
    sbx = gateway.admit(POLICY)
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "api.allowed.test:443")
    assert resp.status == 200
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        world_tls(world, sock, sni)
    time.sleep(SETTLE)
    tls_events = [h for h in world.hits(mark, listener="upstream-tls") if h["event"] in ("tls", "request")]
    assert tls_events == [], tls_events
    assert world.hits(mark, listener="forbidden-tls") == []
    # positive control: forbidden.test is live, and reachable when a policy allows it
    if sni == "forbidden.test":
        curl = gateway.curl(gateway.admit("escape-forbidden"), "https://forbidden.test/")
        assert curl.status == 200, curl


@pytest.mark.parametrize(("target", "reasons"), [
    ("metadata.evil.test:443", {"metadata_endpoint"}),
    ("169.254.169.254:443", {"metadata_endpoint"}),
    ("private.evil.test:443", {"address_forbidden"}),
    ("loopback.evil.test:443", {"address_forbidden"}),
    ("mixed.evil.test:443", {"metadata_endpoint", "address_forbidden"}),
])
def test_passthrough_rules_do_not_bypass_address_checks(world: World, gateway: Gateway, target: str, reasons):
    sbx = gateway.admit(POLICY)
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, target)
    sock.close()
    assert resp.status == 403 and resp.json()["reason"] in reasons, resp.raw[:300]
    assert_untouched(world, mark, target)


def test_rebinding_name_is_dialed_at_its_checked_address_only(world: World, gateway: Gateway):
    """rebind.evil.test alternates upstream / metadata: every tunnel either reaches the upstream (the
    address it was checked at) or is refused; the metadata canary never sees a connection."""
    sbx = gateway.admit(POLICY)
    mark = world.mark()
    reached = 0
    for _ in range(4):
        sock, resp = gateway.tunnel(sbx, "rebind.evil.test:443")
        if resp.status != 200:
            sock.close()
            continue
        with world_tls(world, sock, "rebind.evil.test") as tls:
            reached += get(tls, "rebind.evil.test", "/rebind") == 200
    assert reached >= 1
    assert_untouched(world, mark, "rebind.evil.test")


# ------------------------------------------------------------------ the transparent listener
@pytest.fixture(scope="module")
def tpt(world: World, gateway: Gateway) -> Iterator[Transparent]:
    t = Transparent.create(world, gateway, tag="tpt", net=NET, table="egT_pt")
    try:
        nw.sh("ip", "-n", t.ns, "addr", "add", f"{SOURCE}/32", "dev", f"{nw.PREFIX}{world.sid}tptb")
        gateway.admit(POLICY, address=SOURCE)
        yield t
    finally:
        t.close()


def test_transparent_passthrough_name_is_spliced_and_audited(tpt: Transparent, world: World, gateway: Gateway):
    mark = world.mark()
    sock = tpt.connect(UPSTREAM, 443, SOURCE)
    with world_tls(world, sock, "api.allowed.test") as tls:
        assert get(tls, "api.allowed.test", "/tpt") == 200
    [req] = requests_on(world, mark, "upstream-tls")
    assert (req["sni"], req["target"]) == ("api.allowed.test", "/tpt")
    sbx = gateway.admit(POLICY, address=SOURCE)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [json.loads(ln) for ln in complete_lines(gateway.tmp / "var" / "audit.jsonl") if sbx.id in ln]
        records = [flatten_otlp(rec) for rec in lines]
        if len([r for r in records if r.get("egressgate.operation") == "outcome"]) >= 1:
            break
        time.sleep(0.1)
    [decision] = [r for r in records if r.get("egressgate.operation") == "connect"]
    [outcome] = [r for r in records if r.get("egressgate.operation") == "outcome"]
    assert decision["egressgate.tls"] == outcome["egressgate.tls"] == "passthrough"
    assert decision["egressgate.mode"] == outcome["egressgate.mode"] == "transparent"
    assert decision["egressgate.rule"] == "pt-api" and decision["egressgate.decision"] == "allow"
    assert outcome["egressgate.request.id"] == decision["egressgate.request.id"]
    assert int(outcome["egressgate.bytes.out"]) > 0 and int(outcome["egressgate.bytes.in"]) > 0


def test_transparent_ordinary_rule_is_still_intercepted(tpt: Transparent, world: World):
    """Control for the choice by SNI: other.allowed.test (an ordinary rule) gets the gateway's certificate,
    which the world CA alone does not verify; with the gateway CA it is served (intercepted)."""
    with pytest.raises(ssl.SSLCertVerificationError):
        world_tls(world, tpt.connect(UPSTREAM, 443, SOURCE), "other.allowed.test")
    mark = world.mark()
    with tpt.tls(tpt.connect(UPSTREAM, 443, SOURCE), "other.allowed.test") as tls:
        assert get(tls, "other.allowed.test", "/intercepted") == 200
    [req] = requests_on(world, mark, "upstream-tls")
    assert req["sni"] == "other.allowed.test"


@pytest.mark.parametrize(("dst", "sni"), [
    ("169.254.169.254", "api.allowed.test"),  # the original destination is never dialed
    (UPSTREAM, "metadata.evil.test"),        # a passthrough name that resolves to the canary
    (UPSTREAM, "private.evil.test"),
])
def test_transparent_passthrough_never_reaches_a_canary(tpt: Transparent, world: World, dst: str, sni: str):
    mark = world.mark()
    try:
        with world_tls(world, tpt.connect(dst, 443, SOURCE), sni) as tls:
            status = get(tls, sni, "/canary")
        assert sni == "api.allowed.test" and status == 200  # spliced to the *pinned* upstream
    except (ssl.SSLError, ConnectionError, OSError):
        assert sni != "api.allowed.test"
    assert_untouched(world, mark, f"{dst} / {sni}")


def test_transparent_splice_enters_the_sandbox_history(tpt: Transparent, world: World, gateway: Gateway):
    """`other.allowed.test` is allowed only `unless_request_to: [api.allowed.test]`: reachable (intercepted)
    before, refused once the sandbox reached api.allowed.test through a transparent splice."""
    source = f"{NET}.7"
    nw.sh("ip", "-n", tpt.ns, "addr", "add", f"{source}/32", "dev", f"{nw.PREFIX}{world.sid}tptb")
    gateway.admit("escape-passthrough-history", address=source)
    with tpt.tls(tpt.connect(UPSTREAM, 443, source), "other.allowed.test") as tls:
        assert get(tls, "other.allowed.test", "/before") == 200  # positive control
    with world_tls(world, tpt.connect(UPSTREAM, 443, source), "api.allowed.test") as tls:
        assert get(tls, "api.allowed.test", "/spliced") == 200
    with tpt.tls(tpt.connect(UPSTREAM, 443, source), "other.allowed.test") as tls:
        tls.sendall(b"GET /after HTTP/1.1\r\nHost: other.allowed.test\r\nConnection: close\r\n\r\n")
        resp = read_response(tls)
    assert resp.status == 403 and resp.json()["reason"] == "condition_failed", resp.raw[:300]
