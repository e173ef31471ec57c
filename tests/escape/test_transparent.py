"""The transparent listener end to end: a sandbox whose TCP is DNATed to the gateway (no proxy settings).

Every test runs its client in the `tsb` namespace (tests/support/transparent.py): nothing but the gateway stands
between it and the world's canaries. Positive controls: allowed HTTPS and HTTP reach the real upstream,
and the canaries the adversarial tests aim at are live and reachable from the `open` namespace.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.escape.checks import assert_untouched, requests_on
from tests.networld import World
from tests.support.netgateway import Gateway
from tests.support.transparent import UPSTREAM, Transparent


@pytest.fixture(scope="module")
def tp(world: World, gateway: Gateway) -> Iterator[Transparent]:
    t = Transparent.create(world, gateway)
    try:
        yield t
    finally:
        t.close()


def read_responses(sock, n: int) -> list:
    """`n` pipelined responses (each Content-Length framed) from one connection."""
    from tests.support.http1 import parse_response, read_all
    data = read_all(sock, 1.0, first=10)
    out = []
    for _ in range(n):
        resp = parse_response(data)
        length = int(resp.headers.get("content-length", "0"))
        head_len = data.index(b"\r\n\r\n") + 4
        resp.body = data[head_len:head_len + length]
        data = data[head_len + length:]
        out.append(resp)
    return out


def audited(gateway: Gateway, resp) -> dict:
    """The audit record of a deny (by the request id its body names), checked for the deny contract."""
    assert resp.denied, resp.raw[:400]
    body = resp.json()
    assert body["error"] == "egress_denied" and body["message"]
    record = gateway.audit_record(body["request_id"])
    assert record["egressgate.reason"] == body["reason"]
    assert record["egressgate.mode"] == "transparent"
    return record


def test_allowed_https_reaches_the_upstream(tp: Transparent, world: World):
    mark = world.mark()
    resp = tp.https(UPSTREAM, "api.allowed.test", "api.allowed.test")
    assert resp.status == 200, resp.raw[:400]
    reqs = requests_on(world, mark, "upstream-tls")
    assert [(r["sni"], r["host"]) for r in reqs] == [("api.allowed.test", "api.allowed.test")]


def test_allowed_http_reaches_the_upstream(tp: Transparent, world: World):
    mark = world.mark()
    resp = tp.http(UPSTREAM, "api.allowed.test")
    assert resp.status == 200, resp.raw[:400]
    assert [r["host"] for r in requests_on(world, mark, "upstream-http")] == ["api.allowed.test"]


def test_allowed_https_record_names_the_sandbox_and_the_dialed_address(tp: Transparent, gateway: Gateway):
    resp = tp.https(UPSTREAM, "api.allowed.test", "api.allowed.test")
    assert resp.status == 200
    record = gateway.audit_record(resp.headers["x-egressgate-request-id"])
    assert record["egressgate.sandbox.id"] == tp.sbx.id and record["egressgate.mode"] == "transparent"
    assert record["egressgate.original_dst"] == f"{UPSTREAM}:443"
    assert record["egressgate.decision"] == "allow" and record["server.address"] == "api.allowed.test"


# ------------------------------------------------------------------ the original destination is never dialed
def test_canary_reachable_from_open_namespace(world: World):
    """Positive control for the canary tests below: the private canaries are live and routable."""
    mark = world.mark()
    for url in ("https://10.0.0.5/", "http://10.0.0.5/", "http://169.254.169.254/"):
        world.curl(world.open, "-k", url)
    hit = {h["listener"] for h in world.canary_hits(mark)}
    assert {"private-tls", "private", "metadata"} <= hit


def test_canary_ip_with_allowed_sni_goes_to_the_named_upstream(tp: Transparent, world: World):
    mark = world.mark()
    resp = tp.https("10.0.0.5", "api.allowed.test", "api.allowed.test")
    assert resp.status == 200, resp.raw[:400]
    assert_untouched(world, mark, "by a transparent TLS connection dialed to 10.0.0.5")
    assert [r["sni"] for r in requests_on(world, mark, "upstream-tls")] == ["api.allowed.test"]


def test_canary_ip_with_allowed_host_goes_to_the_named_upstream(tp: Transparent, world: World):
    mark = world.mark()
    resp = tp.http("169.254.169.254", "api.allowed.test")
    assert resp.status == 200, resp.raw[:400]
    assert_untouched(world, mark, "by a transparent HTTP connection dialed to 169.254.169.254")
    assert [r["host"] for r in requests_on(world, mark, "upstream-http")] == ["api.allowed.test"]


@pytest.mark.parametrize("sni", ["0xa9.0xfe.0xa9.0xfe", "169.254.169.254."])
def test_ip_literal_sni_of_metadata_is_judged_as_the_literal(tp: Transparent, world: World, gateway: Gateway,
                                                            sni: str):
    """The policy allows 169.254.169.254 by rule: only the address check can refuse it (Python sends no
    SNI for a plain dotted quad, so the literal is spelled the ways canon_host still reads as one)."""
    mark = world.mark()
    resp = tp.https(UPSTREAM, sni, "169.254.169.254")
    record = audited(gateway, resp)
    assert record["egressgate.reason"] == "metadata_endpoint"
    assert record["egressgate.sandbox.id"] == tp.sbx.id
    assert_untouched(world, mark)
    assert requests_on(world, mark, "upstream-tls") == []


@pytest.mark.parametrize(("dst", "host", "reason"), [
    (UPSTREAM, "169.254.169.254", "metadata_endpoint"),
    (UPSTREAM, "10.0.0.5", "address_forbidden"),
    ("10.0.0.5", "10.0.0.5", "address_forbidden"),
    (UPSTREAM, "metadata.google.internal", "metadata_endpoint"),
])
def test_ip_literal_host_of_metadata_or_private_is_refused(tp: Transparent, world: World, gateway: Gateway,
                                                          dst: str, host: str, reason: str):
    mark = world.mark()
    resp = tp.http(dst, host)
    record = audited(gateway, resp)
    assert record["egressgate.reason"] == reason and record["egressgate.sandbox.id"] == tp.sbx.id
    assert_untouched(world, mark)
    assert requests_on(world, mark, "upstream-http") == []


# ------------------------------------------------------------------ names must agree
def test_sni_host_mismatch_is_refused(tp: Transparent, world: World, gateway: Gateway):
    mark = world.mark()
    resp = tp.https(UPSTREAM, "api.allowed.test", "other.allowed.test")
    assert resp.status == 421
    record = audited(gateway, resp)
    assert record["egressgate.reason"] == "host_mismatch" and record["egressgate.sandbox.id"] == tp.sbx.id
    assert requests_on(world, mark, "upstream-tls") == []


def test_no_sni_is_refused_inside_intercepted_tls(tp: Transparent, world: World, gateway: Gateway):
    mark = world.mark()
    resp = tp.https(UPSTREAM, None, "api.allowed.test")
    record = audited(gateway, resp)
    assert record["egressgate.reason"] == "invalid_request" and record["egressgate.sandbox.id"] == tp.sbx.id
    assert world.hits(mark, listener="upstream-tls") == []  # not even a TCP accept


def test_no_host_is_refused(tp: Transparent, world: World, gateway: Gateway):
    mark = world.mark()
    resp = tp.http(UPSTREAM, None)
    record = audited(gateway, resp)
    assert record["egressgate.reason"] == "invalid_request"
    assert world.hits(mark, listener="upstream-http") == []


def test_host_switch_between_pipelined_requests_is_refused(tp: Transparent, world: World, gateway: Gateway):
    """The first Host binds the connection; a second request naming another host on the same upstream
    connection (Host spoofing) is refused, and the other host's server sees nothing."""
    mark = world.mark()
    with tp.connect(UPSTREAM, 80) as sock:
        sock.sendall(b"GET /one HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n"
                     b"GET /two HTTP/1.1\r\nHost: forbidden.test\r\n\r\n")
        first, second = read_responses(sock, 2)
    assert first.status == 200, first.raw[:300]
    assert second.status == 421
    assert audited(gateway, second)["egressgate.reason"] == "host_mismatch"
    assert [r["target"] for r in requests_on(world, mark, "upstream-http")] == ["/one"]
    assert requests_on(world, mark, "forbidden-http") == []


def test_host_switch_after_tls_sni_is_refused(tp: Transparent, world: World, gateway: Gateway):
    mark = world.mark()
    with tp.tls(tp.connect(UPSTREAM, 443), "api.allowed.test") as tsock:
        tsock.sendall(b"GET /one HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n")
        from tests.support.http1 import read_response
        first = read_response(tsock)
        tsock.sendall(b"GET /two HTTP/1.1\r\nHost: forbidden.test\r\n\r\n")
        second = read_response(tsock)
    assert first.status == 200 and second.status == 421
    assert [r["target"] for r in requests_on(world, mark, "upstream-tls")] == ["/one"]
    assert requests_on(world, mark, "forbidden-tls") == []


# ------------------------------------------------------------------ identity
def test_unknown_source_is_refused_over_tls(tp: Transparent, world: World, gateway: Gateway):
    from tests.support.transparent import UNKNOWN_SOURCE
    mark = world.mark()
    resp = tp.https(UPSTREAM, "api.allowed.test", "api.allowed.test", source=UNKNOWN_SOURCE)
    record = audited(gateway, resp)
    assert resp.status == 407 and record["egressgate.reason"] == "identity_unknown"
    assert record["client.address"] == UNKNOWN_SOURCE
    assert world.hits(mark, listener="upstream-tls") == []


def test_unknown_source_is_refused_over_http(tp: Transparent, world: World, gateway: Gateway):
    from tests.support.transparent import UNKNOWN_SOURCE
    mark = world.mark()
    resp = tp.http(UPSTREAM, "api.allowed.test", source=UNKNOWN_SOURCE)
    assert audited(gateway, resp)["egressgate.reason"] == "identity_unknown"
    assert world.hits(mark, listener="upstream-http") == []


def test_proxy_authorization_is_not_an_identity(tp: Transparent, world: World, gateway: Gateway):
    """An unknown source cannot borrow a sandbox's identity with Proxy-Authorization (it is never read)."""
    from tests.support.http1 import read_response
    from tests.support.transparent import UNKNOWN_SOURCE
    mark = world.mark()
    with tp.connect(UPSTREAM, 80, source=UNKNOWN_SOURCE) as sock:
        sock.sendall(f"GET / HTTP/1.1\r\nHost: api.allowed.test\r\nProxy-Authorization: {tp.sbx.auth_header}"
                     f"\r\n\r\n".encode())
        resp = read_response(sock)
    assert audited(gateway, resp)["egressgate.reason"] == "identity_unknown"
    assert world.hits(mark, listener="upstream-http") == []


def test_revoked_sandbox_is_refused(tp: Transparent, world: World, gateway: Gateway):
    from tests.support.launcher import EGRESSGATE
    from tests.support.transparent import REVOKED_SOURCE
    victim = gateway.admit("escape-transparent", address=REVOKED_SOURCE)
    assert tp.http(UPSTREAM, "api.allowed.test", source=REVOKED_SOURCE).status == 200  # control
    res = world.exec(world.gw, EGRESSGATE, "sandbox", "revoke", "--config", str(gateway.config), victim.id)
    assert res.returncode == 0, res.stderr
    mark = world.mark()
    for resp in (tp.http(UPSTREAM, "api.allowed.test", source=REVOKED_SOURCE),
                 tp.https(UPSTREAM, "api.allowed.test", "api.allowed.test", source=REVOKED_SOURCE)):
        record = audited(gateway, resp)
        assert record["egressgate.reason"] == "sandbox_revoked" and record["egressgate.sandbox.id"] == victim.id
    assert requests_on(world, mark, "upstream-http") == requests_on(world, mark, "upstream-tls") == []


# ------------------------------------------------------------------ proxy forms and raw TCP
def test_connect_to_the_transparent_listener_is_refused(tp: Transparent, world: World, gateway: Gateway):
    from tests.support.http1 import parse_response, read_all
    mark = world.mark()
    with tp.connect(UPSTREAM, 80) as sock:
        sock.sendall(b"CONNECT api.allowed.test:443 HTTP/1.1\r\nHost: api.allowed.test:443\r\n"
                     + f"Proxy-Authorization: {tp.sbx.auth_header}\r\n\r\n".encode())
        resp = parse_response(read_all(sock, 2.0, first=10))
    record = audited(gateway, resp)
    assert record["egressgate.reason"] == "protocol_not_allowed" and record["egressgate.sandbox.id"] == tp.sbx.id
    assert world.hits(mark, listener="upstream-tls") == world.hits(mark, listener="upstream-http") == []


def test_absolute_form_to_the_transparent_listener_is_refused(tp: Transparent, world: World, gateway: Gateway):
    mark = world.mark()
    with tp.connect(UPSTREAM, 80) as sock:
        resp = tp.request(sock, "api.allowed.test", target="http://api.allowed.test/")
    assert audited(gateway, resp)["egressgate.reason"] == "protocol_not_allowed"
    assert requests_on(world, mark, "upstream-http") == []


def test_non_http_tcp_without_a_tcp_rule_is_refused(tp: Transparent, world: World, gateway: Gateway):
    from tests.support.http1 import parse_response, read_all
    mark = world.mark()
    with tp.connect("10.0.0.5", 80) as sock:
        sock.sendall(b"\x00\x01\x02 binary protocol bytes\r\n")
        resp = parse_response(read_all(sock, 2.0, first=10))
    record = audited(gateway, resp)
    assert record["egressgate.reason"] == "address_forbidden" and record["egressgate.sandbox.id"] == tp.sbx.id
    with tp.connect(UPSTREAM, 2223) as sock:
        sock.sendall(b"\x00\x01\x02 binary protocol bytes\r\n")
        resp = parse_response(read_all(sock, 2.0, first=10))
    assert audited(gateway, resp)["egressgate.reason"] == "protocol_not_allowed"
    assert_untouched(world, mark)


def test_non_http_tcp_with_a_tcp_rule_for_the_ip_is_relayed(tp: Transparent, world: World, gateway: Gateway):
    """Positive control for the raw-TCP refusal: a tcp rule for 198.18.1.10:2222 lets raw bytes through."""
    from tests.support.http1 import read_all
    mark = world.mark()
    with tp.connect(UPSTREAM, 2222) as sock:
        sock.sendall(b"\x00\x01 raw hello")
        got = read_all(sock, 1.0, first=10)
    assert got.startswith(b"RAW-ACK"), got
    assert [h["event"] for h in world.hits(mark, listener="upstream-raw")][:2] == ["accept", "data"]


def test_server_first_protocol_with_a_tcp_rule_is_relayed(tp: Transparent, world: World, gateway: Gateway):
    """A server-first protocol (the client waits for a banner): after a second of client silence the
    gateway relays raw TCP because a tcp rule allows 198.18.1.10:2224, and the record says so."""
    from tests.support.http1 import read_all
    mark = world.mark()
    with tp.connect(UPSTREAM, 2224) as sock:
        got = read_all(sock, 1.0, first=10)
        assert got.startswith(b"BANNER upstream-banner"), got
        sock.sendall(b"HELO client")
        assert read_all(sock, 1.0, first=10).startswith(b"RAW-ACK")
    assert [h["event"] for h in world.hits(mark, listener="upstream-banner")][:2] == ["accept", "data"]


def test_server_first_protocol_without_a_tcp_rule_is_never_dialed(tp: Transparent, world: World):
    """Same banner server on a port no rule allows: the silent client gets nothing, and the server sees
    no connection (the gateway waits for the client's bytes instead of dialing the original address)."""
    import socket

    from tests.support.http1 import read_all

    def direct() -> bytes:  # positive control: the server is live and speaks first to a direct client
        with socket.create_connection((UPSTREAM, 2225), timeout=10) as s:
            return read_all(s, 1.0, first=10)
    assert world.in_ns(world.open, direct).startswith(b"BANNER upstream-banner-denied")
    mark = world.mark()
    with tp.connect(UPSTREAM, 2225) as sock:
        assert read_all(sock, 3.0, first=3.0) == b""
    assert world.hits(mark, listener="upstream-banner-denied") == []


@pytest.mark.parametrize(("source", "sni", "reason"), [
    ("unknown", "api.allowed.test", "identity_unknown"),
    ("sandbox", "forbidden.test", None),
    ("sandbox", "api.allowed.test", "protocol_not_allowed"),
])
def test_connect_inside_transparent_tls_is_refused(tp: Transparent, world: World, gateway: Gateway,
                                                  source: str, sni: str, reason: str | None):
    """Inside the TLS of a transparent connection (refused or allowed), a CONNECT carrying a valid
    sandbox's Proxy-Authorization is not a way in: the credentials are never read, nothing is dialed."""
    from tests.support.http1 import read_response
    from tests.support.transparent import UNKNOWN_SOURCE
    mark = world.mark()
    src = UNKNOWN_SOURCE if source == "unknown" else None
    with tp.tls(tp.connect(UPSTREAM, 443, src), sni) as tsock:
        tsock.sendall(f"CONNECT api.allowed.test:443 HTTP/1.1\r\nHost: api.allowed.test:443\r\n"
                      f"Proxy-Authorization: {tp.sbx.auth_header}\r\n\r\n".encode())
        resp = read_response(tsock)
    record = audited(gateway, resp)
    assert record["egressgate.reason"] == (reason or "host_not_allowed")  # None: the SNI refusal stands
    assert requests_on(world, mark, "upstream-tls") == requests_on(world, mark, "forbidden-tls") == []
    if source == "unknown" or reason is None:  # a refused connection dials nothing at all
        assert world.hits(mark, listener="upstream-tls") == world.hits(mark, listener="forbidden-tls") == []


def test_h2_streams_are_decided_on_their_authority(tp: Transparent, world: World):
    """HTTP/2 on the transparent listener: the SNI binds the connection, every stream's :authority must
    name it (stream-level fronting refused); control: the consistent streams reach upstream-h2."""
    import time

    from tests.escape.checks import SETTLE
    from tests.escape.h2streams import GOOD, STREAMS, exchange
    mark = world.mark()
    with tp.tls(tp.connect(UPSTREAM, 9443), "api.allowed.test", alpn=("h2",)) as tls:
        assert tls.selected_alpn_protocol() == "h2"
        result = exchange(tls, STREAMS)
    time.sleep(SETTLE)
    assert result.get(1) == 200 and result.get(9) == 200, result
    for sid in (3, 5, 7):
        assert result.get(sid) in (403, 421, "reset", "closed"), result
    authorities = [r["authority"] or r["host"] for r in requests_on(world, mark, "upstream-h2")]
    assert authorities and set(authorities) <= {GOOD, "api.allowed.test"}, authorities
    assert world.hits(mark, listener="forbidden-tls") == []
    assert_untouched(world, mark, "h2 streams on the transparent listener")


# ------------------------------------------------------------------ Host with a port
def test_host_with_the_dialed_port_is_allowed(tp: Transparent, world: World):
    """Clients write the port in Host (always for a non-default port, some even for 80): it is split
    off, not judged as part of the name (was refused as invalid_request)."""
    mark = world.mark()
    resp = tp.http(UPSTREAM, "api.allowed.test:80")
    assert resp.status == 200, resp.raw[:400]
    assert [r["host"] for r in requests_on(world, mark, "upstream-http")] == ["api.allowed.test:80"]


@pytest.mark.parametrize("host", ["api.allowed.test:8080", "api.allowed.test:0", "api.allowed.test:x"])
def test_host_with_another_port_is_refused(tp: Transparent, world: World, gateway: Gateway, host: str):
    """The port a Host names must be the dialed one (consistency.py, as on the explicit proxy)."""
    mark = world.mark()
    resp = tp.http(UPSTREAM, host)
    record = audited(gateway, resp)
    assert record["egressgate.reason"] in ("host_mismatch", "invalid_request"), record
    assert record["egressgate.sandbox.id"] == tp.sbx.id
    assert requests_on(world, mark, "upstream-http") == []
