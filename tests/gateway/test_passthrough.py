"""`tls: passthrough` routes through the real gateway: the ClientHello check, the splice, budgets, audit.

The client trusts only the *upstream's* CA (the test CA), never the gateway's: a handshake that completes
proves the TLS was not intercepted. Refusals are checked against what the upstream saw (its SNI log and
its request log) so a bypass would show up as an upstream hit, and each refusal has a positive control:
the same bytes with the one difference removed reach the upstream.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import yaml

from tests.support.gwworld import connect_tunnel, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

ALERT_ACCESS_DENIED = b"\x15\x03\x03\x00\x02\x02\x31"
ALERT_ILLEGAL_PARAMETER = b"\x15\x03\x03\x00\x02\x02\x2f"


@dataclass
class HrrUpstream:
    """A TLS 1.3 upstream that only accepts P-256 key shares: Python's client offers X25519 first, so
    every handshake starts with a HelloRetryRequest and a second ClientHello. `snis` logs every SNI its
    OpenSSL servername callback was called with (once per ClientHello)."""

    port: int
    snis: list


@pytest.fixture(scope="module")
def hrr(world) -> Iterator[HrrUpstream]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    world.ca.issue_cert("hrr.test", "oth.test").configure_cert(ctx)
    ctx.set_ecdh_curve("prime256v1")
    snis: list = []
    ctx.sni_callback = lambda _sock, name, _ctx: snis.append(name)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def serve_one(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(10)
            tls = ctx.wrap_socket(conn, server_side=True)
            data = b""
            while b"\r\n\r\n" not in data and (chunk := tls.recv(4096)):
                data += chunk
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nhrr")
            tls.close()
        conn.close()

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    world.dns.records["hrr.test"] = "127.0.0.1"
    try:
        yield HrrUpstream(server.getsockname()[1], snis)
    finally:
        server.close()


@pytest.fixture(scope="module")
def gw(world, hrr, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-passthrough")
    https, canary = world.https_port, world.canary_https_port
    (tmp / "policies").mkdir()

    def write(name: str, network: dict, resources: dict | None = None, private=("127.0.0.1/32",)) -> None:
        sandbox = {"name": name, **({"resources": resources} if resources else {})}
        doc = {"sandbox": sandbox, "network": {"allow_private": list(private), **network}}
        (tmp / "policies" / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))

    write("pt", {"https": {"allow": [
        {"id": "pt-api", "host": "api.test", "ports": [https], "tls": "passthrough"},
        {"id": "pt-literal", "host": "127.0.0.1", "ports": [https], "tls": "passthrough"},
        {"id": "pt-canary", "host": "canary.test", "ports": [canary], "tls": "passthrough"},
        {"id": "pt-hrr", "host": "hrr.test", "ports": [hrr.port], "tls": "passthrough"},
    ]}})
    write("pt-once", {"https": {"allow": [{"id": "pt-once", "host": "api.test", "ports": [https],
                                           "tls": "passthrough", "budget": {"requests": 1}}]}})
    # the sandbox's history: upload.test (other.test) only while it never reached api.test or tcp.test
    write("pt-history", {
        "https": {"allow": [
            {"id": "pt-secrets", "host": "api.test", "ports": [https], "tls": "passthrough"},
            {"id": "upload", "host": "other.test", "ports": [https],
             "when": {"unless_request_to": ["api.test", "tcp.test"]}}]},
        "tcp": {"allow": [{"id": "raw", "host": "tcp.test", "ports": [world.tcp_port]}]}})
    write("pt-budget", {"https": {"allow": [{"id": "pt-api", "host": "api.test", "ports": [https],
                                             "tls": "passthrough"}]}}, {"outbound_bytes_max": 6000})
    write("pt-lease", {"https": {"allow": [{"id": "pt-api", "host": "api.test", "ports": [https],
                                            "tls": "passthrough"}]}}, {"outbound_bytes_max": 2_000_000})
    # positive control for the address check: the canary is reachable when its address is allowed
    write("pt-canary-open", {"https": {"allow": [
        {"id": "pt-canary", "host": "canary.test", "ports": [canary], "tls": "passthrough"}]}},
        private=("127.0.0.0/8",))
    gateway = start_gateway(world, tmp)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


def upstream_ctx(world) -> ssl.SSLContext:
    """Trusts the upstream's CA only: a gateway that intercepted would fail this verification."""
    return ssl.create_default_context(cadata=world.ca.cert_pem.bytes().decode())


def client_hello(world, sni: str | None) -> bytes:
    """The real first flight of Python's TLS client for `sni` (None: no SNI), captured from a MemoryBIO."""
    ctx = upstream_ctx(world)
    if sni is None:
        ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def with_extension(record: bytes, ext_type: int, body: bytes) -> bytes:
    """`record` (one TLS record holding a ClientHello) with one more extension appended, lengths fixed."""
    hs = record[5:]
    at = 4 + 2 + 32
    at += 1 + hs[at]  # session id
    at += 2 + struct.unpack("!H", hs[at:at + 2])[0]  # cipher suites
    at += 1 + hs[at]  # compression methods
    ext_len = struct.unpack("!H", hs[at:at + 2])[0]
    exts = hs[at + 2:at + 2 + ext_len] + struct.pack("!HH", ext_type, len(body)) + body
    body_out = hs[4:at] + struct.pack("!H", len(exts)) + exts
    handshake = b"\x01" + len(body_out).to_bytes(3, "big") + body_out
    return record[:3] + struct.pack("!H", len(handshake)) + handshake


def sni_body(*names: bytes) -> bytes:
    entries = b"".join(b"\x00" + struct.pack("!H", len(n)) + n for n in names)
    return struct.pack("!H", len(entries)) + entries


def open_tunnel(gw, sbx, target: str) -> socket.socket:
    sock, head = connect_tunnel(gw, sbx, target)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def refused(sock: socket.socket, alert: bytes = ALERT_ACCESS_DENIED) -> None:
    """The gateway answered with the TLS alert and closed (or reset) the tunnel."""
    sock.settimeout(5)
    got = b""
    try:
        while chunk := sock.recv(100):
            got += chunk
    except ConnectionResetError:
        pass
    assert got == alert, got


def tls_get(world, sock: socket.socket, sni: str, path: str = "/echo", body: bytes = b"") -> bytes:
    tls = upstream_ctx(world).wrap_socket(sock, server_hostname=sni)
    method = "POST" if body else "GET"
    tls.sendall(f"{method} {path} HTTP/1.1\r\nHost: {sni}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n".encode() + body)
    data = b""
    while chunk := tls.recv(65536):
        data += chunk
    tls.close()
    return data


def records(gw, sandbox_id: str, operation: str) -> list[dict]:
    return [r for r in gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox_id
            and r.get("egressgate.operation") == operation]


def outcome(gw, sandbox_id: str) -> dict:
    assert wait_for(lambda: records(gw, sandbox_id, "outcome"), timeout=5)
    [out] = records(gw, sandbox_id, "outcome")
    return out


def test_splice_is_end_to_end_tls_with_one_decision_and_one_outcome(gw, world):
    sbx = gw.admit("pt")
    mark = world.hits.mark()
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    reply = tls_get(world, sock, "api.test", "/echo?pt=1")
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    [hit] = [h for h in world.hits.since(mark) if h["path"] == "/echo?pt=1"]
    assert hit["host"] == "api.test"
    assert "x-egressgate-request-id" not in hit["headers"]  # nothing was added inside the TLS
    [decision] = records(gw, sbx.id, "connect")
    assert (decision["egressgate.decision"], decision["egressgate.rule"]) == ("allow", "pt-api")
    assert decision["egressgate.tls"] == "passthrough"
    out = outcome(gw, sbx.id)
    assert out["egressgate.request.id"] == decision["egressgate.request.id"]
    assert (out["egressgate.decision"], out["egressgate.tls"], out["egressgate.tls.sni"]) == (
        "allow", "passthrough", "api.test")
    assert int(out["egressgate.bytes.out"]) > 300 and int(out["egressgate.bytes.in"]) > len(reply)


def test_sni_naming_another_host_is_refused_before_any_byte_goes_upstream(gw, world):
    """other.test is served by the same upstream (its certificate names it): a tunnel to the allowed
    api.test must not become a session with other.test. Positive control: the same upstream does serve
    other.test to a direct client, and api.test's own ClientHello passes the same tunnel setup."""
    direct = socket.create_connection(("127.0.0.1", world.https_port), timeout=5)
    assert tls_get(world, direct, "other.test").startswith(b"HTTP/1.1 200")  # the upstream would serve it
    sbx = gw.admit("pt")
    snis, mark = len(world.snis), world.hits.mark()
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    sock.sendall(client_hello(world, "other.test"))
    refused(sock)
    time.sleep(0.2)
    assert world.snis[snis:] == [] and world.hits.since(mark) == []
    out = outcome(gw, sbx.id)
    assert (out["egressgate.decision"], out["egressgate.reason"], out["egressgate.detail"]) == (
        "deny", "host_mismatch", "sni_mismatch")
    assert out["egressgate.tls.sni"] == "other.test" and int(out["egressgate.bytes.out"]) == 0
    # positive control: the same path with the CONNECT host's own ClientHello reaches the upstream
    ok = open_tunnel(gw, gw.admit("pt"), f"api.test:{world.https_port}")
    assert tls_get(world, ok, "api.test").startswith(b"HTTP/1.1 200")
    assert "api.test" in world.snis[snis:]


@pytest.mark.parametrize(("sni", "detail"), [(None, "sni_missing"), ("API.test.", None)])
def test_missing_sni_is_refused_and_spelling_is_canonical(gw, world, sni, detail):
    sbx = gw.admit("pt")
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    if detail is None:  # a differently spelled but canonically equal SNI passes (positive control)
        raw = client_hello(world, sni)
        sock.sendall(raw)
        sock.settimeout(5)
        assert sock.recv(5)[:1] == b"\x16"  # the upstream's ServerHello came back through the splice
        sock.close()
        return
    sock.sendall(client_hello(world, sni))
    refused(sock)
    out = outcome(gw, sbx.id)
    assert (out["egressgate.reason"], out["egressgate.detail"]) == ("host_mismatch", detail)


def test_ip_literal_target_may_omit_sni(gw, world):
    sbx = gw.admit("pt")
    sock = open_tunnel(gw, sbx, f"127.0.0.1:{world.https_port}")
    sock.sendall(client_hello(world, None))
    sock.settimeout(5)
    assert sock.recv(5)[:1] == b"\x16"
    sock.close()
    # ...but not name another host in it
    sock = open_tunnel(gw, gw.admit("pt"), f"127.0.0.1:{world.https_port}")
    sock.sendall(client_hello(world, "api.test"))
    refused(sock)


@pytest.mark.parametrize(("mutate", "reason", "detail"), [
    (lambda hello: with_extension(hello, 0xFE0D, b"\x00" * 40), "protocol_not_allowed", "encrypted_client_hello"),
    (lambda hello: with_extension(hello, 0x0000, sni_body(b"other.test")), "host_mismatch", "sni_ambiguous"),
    (lambda hello: b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n", "protocol_not_allowed", "not_tls"),
    (lambda hello: b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00", "protocol_not_allowed", "not_client_hello"),
])
def test_hostile_client_hellos_are_refused(gw, world, mutate, reason, detail):
    sbx = gw.admit("pt")
    snis, mark = len(world.snis), world.hits.mark()
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    sock.sendall(mutate(client_hello(world, "api.test")))
    refused(sock)
    time.sleep(0.2)
    assert world.snis[snis:] == [] and world.hits.since(mark) == []
    out = outcome(gw, sbx.id)
    assert (out["egressgate.decision"], out["egressgate.reason"], out["egressgate.detail"]) == (
        "deny", reason, detail)


def test_split_client_hello_is_reassembled_and_still_checked(gw, world):
    """Byte-by-byte delivery (over many reads) changes nothing: the good SNI passes, the bad one is refused."""
    for sni, passes in (("api.test", True), ("other.test", False)):
        sock = open_tunnel(gw, gw.admit("pt"), f"api.test:{world.https_port}")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = client_hello(world, sni)
        for i in range(0, 60):
            sock.send(hello[i:i + 1])
            time.sleep(0.002)
        sock.sendall(hello[60:])
        if passes:
            sock.settimeout(5)
            assert sock.recv(5)[:1] == b"\x16"
            sock.close()
        else:
            refused(sock)


def test_client_hello_over_the_bound_is_refused(gw, world):
    sbx = gw.admit("pt")
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    # a ClientHello announcing 70000 bytes (the default bound is 64 KiB), in its first record
    sock.sendall(b"\x16\x03\x01\x00\x10" + b"\x01" + (70000).to_bytes(3, "big") + b"\x03\x03" + b"\x00" * 10)
    refused(sock, ALERT_ILLEGAL_PARAMETER)
    out = outcome(gw, sbx.id)
    assert (out["egressgate.reason"], out["egressgate.detail"]) == ("client_hello_too_large",
                                                                   "max_client_hello_bytes")


def test_private_pinned_target_is_still_refused(gw, world):
    """A passthrough rule does not bypass the address check: canary.test resolves to the canary's
    127.0.0.2, which `pt` does not allow. Positive control: `pt-canary-open` allows it and reaches it."""
    mark = world.canary.mark()
    sock, head = connect_tunnel(gw, gw.admit("pt"), f"canary.test:{world.canary_https_port}")
    assert head.startswith(b"HTTP/1.1 403") and b"address_forbidden" in head
    sock.close()
    assert world.canary.since(mark) == []
    sock = open_tunnel(gw, gw.admit("pt-canary-open"), f"canary.test:{world.canary_https_port}")
    assert tls_get(world, sock, "canary.test", "/echo?canary=pt").startswith(b"HTTP/1.1 200")
    assert [h["path"] for h in world.canary.since(mark)] == ["/echo?canary=pt"]


def test_budget_cuts_the_splice_at_the_limit(gw, world):
    """6000 bytes out: a small request fits (positive control), a 20 000-byte upload is cut mid-body,
    the upstream never sees it complete, and the outcome says budget_exceeded."""
    sbx = gw.admit("pt-budget")
    small = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    assert tls_get(world, small, "api.test", "/echo?small=1").startswith(b"HTTP/1.1 200")
    mark = world.hits.mark()
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    tls = upstream_ctx(world).wrap_socket(sock, server_hostname="api.test")
    with pytest.raises(OSError):
        tls.sendall(b"POST /upload HTTP/1.1\r\nHost: api.test\r\nContent-Length: 20000\r\n\r\n")
        for _ in range(20):
            tls.sendall(b"x" * 1000)
            time.sleep(0.01)
        tls.recv(100) or (_ for _ in ()).throw(OSError("closed"))
    time.sleep(0.3)
    assert [h for h in world.hits.since(mark) if h["path"] == "/upload"] == []
    assert wait_for(lambda: len(records(gw, sbx.id, "outcome")) == 2, timeout=5)
    cut = [r for r in records(gw, sbx.id, "outcome") if r.get("egressgate.budget_cut")]
    assert len(cut) == 1 and cut[0]["egressgate.reason"] == "budget_exceeded"
    total = sum(int(r["egressgate.bytes.out"]) for r in records(gw, sbx.id, "outcome"))
    assert total <= 6000


def test_splice_pauses_for_its_lease_and_relays_intact(gw, world):
    """2 MB budget: a 1.5 MB upload through one spliced tunnel needs many lease top-ups (each pauses
    the client's socket until the store answered); every byte arrives, in order, and the request is
    answered. A second 1 MB upload then crosses the budget and is cut; the total stays under it."""
    sbx = gw.admit("pt-lease")
    mark = world.hits.mark()
    body = bytes(range(256)) * (1_500_000 // 256)
    reply = tls_get(world, open_tunnel(gw, sbx, f"api.test:{world.https_port}"), "api.test", "/upload?lease=1", body)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    [hit] = [h for h in world.hits.since(mark) if h["path"] == "/upload?lease=1"]
    assert hit["body_len"] == len(body) and hit["body_head"].encode("latin-1") == body[:4096]
    # the store charged exactly what the tunnel relayed (layer and splice, once each byte), lease returned
    assert wait_for(lambda: len(records(gw, sbx.id, "outcome")) == 1, timeout=5)
    relayed = int(records(gw, sbx.id, "outcome")[0]["egressgate.bytes.out"])
    assert wait_for(lambda: usage_out(gw, sbx.id) == relayed, timeout=5), (usage_out(gw, sbx.id), relayed)
    with pytest.raises(OSError):
        tls_get(world, open_tunnel(gw, sbx, f"api.test:{world.https_port}"), "api.test", "/upload?lease=2",
                b"z" * 1_000_000)
    time.sleep(0.3)
    assert [h for h in world.hits.since(mark) if h["path"] == "/upload?lease=2"] == []
    assert wait_for(lambda: len(records(gw, sbx.id, "outcome")) == 2, timeout=5)
    total = sum(int(r["egressgate.bytes.out"]) for r in records(gw, sbx.id, "outcome"))
    assert len(body) < total <= 2_000_000


def usage_out(gw, sandbox_id: str) -> int:
    """The store's bytes_out for the sandbox (control API)."""
    res = httpx.get(f"http://{gw.admin}/v1/sandboxes/{sandbox_id}", headers={"Authorization": f"Bearer {gw.token}"},
                    timeout=10, trust_env=False)
    assert res.status_code == 200, res.text
    return int(res.json()["usage"]["bytes_out"])


def test_revocation_cuts_an_open_passthrough_tunnel(gw, world):
    sbx = gw.admit("pt")
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    tls = upstream_ctx(world).wrap_socket(sock, server_hostname="api.test")
    request = b"GET /echo?rev=1 HTTP/1.1\r\nHost: api.test\r\n\r\n"
    tls.sendall(request)
    tls.settimeout(5)
    assert tls.recv(65536).startswith(b"HTTP/1.1 200")  # positive control: the tunnel works
    assert gw.revoke(sbx.id).status_code in (200, 204)
    mark = world.hits.mark()
    with pytest.raises(OSError):
        for _ in range(20):
            tls.sendall(b"GET /echo?rev=2 HTTP/1.1\r\nHost: api.test\r\n\r\n")
            if not tls.recv(65536):
                raise OSError("closed")
            time.sleep(0.05)
    assert [h for h in world.hits.since(mark) if h["path"] == "/echo?rev=2"] == []
    out = outcome(gw, sbx.id)
    assert (out["egressgate.decision"], out["egressgate.reason"]) == ("deny", "sandbox_revoked")


def test_bulk_download_through_the_splice_is_complete_and_counted(gw, world):
    """8 MB through the spliced tunnel to a reader that starts slowly (the gateway's write buffer fills and
    it must stop reading the upstream, not buffer it): every byte arrives, in order, and is counted in."""
    sbx = gw.admit("pt")
    size = 8_000_000
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    tls = upstream_ctx(world).wrap_socket(sock, server_hostname="api.test")
    tls.sendall(f"GET /big?n={size} HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n".encode())
    time.sleep(1.0)  # let the upstream fill every buffer on the way
    data = bytearray()
    while chunk := tls.recv(1 << 20):
        data += chunk
    tls.close()
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and len(body) == size and body.count(b"x") == size
    out = outcome(gw, sbx.id)
    assert out["egressgate.decision"] == "allow" and int(out["egressgate.bytes.in"]) > size


def hrr_exchange(world, sock: socket.socket, second_sni: bytes | None) -> bytes:
    """ClientHello for hrr.test, read the server's HelloRetryRequest, then the client's real second
    ClientHello with its SNI replaced by `second_sni` (same length: the lengths stay valid). Returns
    what came back after the second ClientHello."""
    ctx = upstream_ctx(world)
    ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="hrr.test")
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    sock.sendall(outgoing.read())
    sock.settimeout(5)
    retry = sock.recv(65536)
    assert bytes.fromhex("CF21AD74E59A6111BE1D8C021E65B891C2A211167ABB8C5E079E09E2C8A8339C") in retry
    incoming.write(retry)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    second = outgoing.read()
    assert second.count(b"hrr.test") == 1
    sock.sendall(second.replace(b"hrr.test", second_sni) if second_sni else second)
    got = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            got += chunk
    return got


def test_client_hello_after_a_hello_retry_request_is_checked_too(gw, world, hrr):
    """TLS 1.3 HelloRetryRequest: the client's second ClientHello is in clear and the server acts on its
    SNI again (positive control: sent straight to the upstream, its servername callback sees oth.test).
    Through the tunnel, the same second ClientHello naming oth.test is refused; an honest client's retry
    passes (its handshake completes, and the upstream saw hrr.test twice: the retry did happen)."""
    mark = len(hrr.snis)
    direct = socket.create_connection(("127.0.0.1", hrr.port), timeout=5)
    hrr_exchange(world, direct, b"oth.test")
    direct.close()
    assert wait_for(lambda: "oth.test" in hrr.snis[mark:], timeout=3), hrr.snis[mark:]

    mark = len(hrr.snis)
    sbx = gw.admit("pt")
    sock = open_tunnel(gw, sbx, f"hrr.test:{hrr.port}")
    assert hrr_exchange(world, sock, b"oth.test") == ALERT_ACCESS_DENIED
    time.sleep(0.2)
    assert hrr.snis[mark:] == ["hrr.test"]
    out = outcome(gw, sbx.id)
    assert (out["egressgate.decision"], out["egressgate.reason"], out["egressgate.detail"]) == (
        "deny", "host_mismatch", "sni_mismatch")
    assert out["egressgate.tls.sni"] == "oth.test"

    mark = len(hrr.snis)
    honest = open_tunnel(gw, gw.admit("pt"), f"hrr.test:{hrr.port}")
    assert tls_get(world, honest, "hrr.test").endswith(b"hrr")
    assert hrr.snis[mark:] == ["hrr.test", "hrr.test"]


def test_a_second_client_hello_pipelined_before_the_retry_is_judged_not_relayed(gw, world, hrr):
    """Sent before the server asked for it, a second ClientHello naming another host would be read by
    the server as the retry: the gateway holds what follows a ClientHello until the server answers."""
    mark = len(hrr.snis)
    sbx = gw.admit("pt")
    sock = open_tunnel(gw, sbx, f"hrr.test:{hrr.port}")
    sock.sendall(client_hello(world, "hrr.test") + client_hello(world, "oth.test"))
    got = b""
    sock.settimeout(5)
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            got += chunk
    assert got.endswith(ALERT_ACCESS_DENIED), got[-20:]
    time.sleep(0.2)
    assert hrr.snis[mark:] == ["hrr.test"]
    assert outcome(gw, sbx.id)["egressgate.detail"] == "sni_mismatch"


def test_client_reset_mid_download_ends_the_tunnel_cleanly(gw, world):
    """The sandbox resets its socket in the middle of a spliced download: the upstream side is cut too,
    mitmproxy gets the end handed back (the outcome record is written, so its layers saw the close) and
    the gateway keeps serving (positive control: a new tunnel works)."""
    sbx = gw.admit("pt")
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    tls = upstream_ctx(world).wrap_socket(sock, server_hostname="api.test")
    tls.sendall(b"GET /big?n=50000000 HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
    assert len(tls.recv(65536)) > 0
    tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    tls.close()  # RST
    out = outcome(gw, sbx.id)
    assert out["egressgate.decision"] == "allow" and 0 < int(out["egressgate.bytes.in"]) < 50_000_000
    again = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    assert tls_get(world, again, "api.test").startswith(b"HTTP/1.1 200")
    assert "Traceback" not in (gw.var.parent / "gateway.stderr").read_text()


@pytest.mark.parametrize("via", ["passthrough", "tcp"])
def test_a_relayed_tunnel_enters_the_sandbox_history(gw, world, via):
    """`unless_request_to: [api.test, tcp.test]` on the upload rule: once the sandbox has reached api.test
    through a passthrough tunnel (or tcp.test through a raw TCP one), the upload host is closed to it.
    Positive control: before that contact the same CONNECT to the upload host is allowed."""
    sbx = gw.admit("pt-history")
    before, head = connect_tunnel(gw, sbx, f"other.test:{world.https_port}")
    before.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    if via == "passthrough":
        sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
        assert tls_get(world, sock, "api.test", "/echo?secret=1").startswith(b"HTTP/1.1 200")
    else:
        sock = open_tunnel(gw, sbx, f"tcp.test:{world.tcp_port}")
        sock.sendall(b"secret")
        sock.settimeout(5)
        assert sock.recv(100) == b"echo:secret"
        sock.close()
    after, head = connect_tunnel(gw, sbx, f"other.test:{world.https_port}")
    after.close()
    assert head.startswith(b"HTTP/1.1 403") and b"condition_failed" in head, head


def test_rule_budget_counts_passthrough_tunnels(gw, world):
    """`budget: {requests: 1}` on a passthrough rule: the first tunnel is spliced (positive control), the
    second CONNECT is refused with 429 budget_exceeded before anything is dialed."""
    sbx = gw.admit("pt-once")
    first = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    assert tls_get(world, first, "api.test").startswith(b"HTTP/1.1 200")
    second, head = connect_tunnel(gw, sbx, f"api.test:{world.https_port}")
    second.close()
    assert head.startswith(b"HTTP/1.1 429") and b"budget_exceeded" in head, head


def test_client_half_close_still_gets_the_response(gw, world):
    """The client sends its request and shuts down its sending side (TCP half-close, no TLS close_notify):
    the splice passes the FIN upstream and keeps relaying the response until the upstream closes."""
    sbx = gw.admit("pt")
    sock = open_tunnel(gw, sbx, f"api.test:{world.https_port}")
    tls = upstream_ctx(world).wrap_socket(sock, server_hostname="api.test")
    time.sleep(0.2)  # let the splice take over after the handshake
    tls.sendall(b"GET /big?n=300000 HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
    socket.socket.shutdown(tls, socket.SHUT_WR)  # the TCP FIN only: the TLS session stays usable
    data = bytearray()
    with contextlib.suppress(ssl.SSLError, OSError):
        while chunk := tls.recv(1 << 16):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and len(body) == 300000
