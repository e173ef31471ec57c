"""gRPC through the gateway, with a real grpcio client and server (tests/support/grpcworld.py).

The bug (issue 21): layers/hop_by_hop.py stripped every `te`, including HTTP/2's `te: trailers`, which grpcio
servers require; the server reset each call and the client saw `UNAVAILABLE ... status: 502`. Here: a
direct call (positive control: the world works without the gateway), a unary call, 1,000 server-streamed
messages in order, an error status whose grpc-message survives, and a method the policy does not allow,
which must fail at the client and never reach the server (its hit counter proves it).

Adversarial (raw h2 client through a real CONNECT tunnel, to an upstream that records what it got
without validating it): whatever te a client sends, the upstream sees at most one `te: trailers` and
never any other value.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from tests.support.grpcworld import FAIL_MESSAGE, H2REC, HOST, GrpcWorld, channel, method, open_grpc_world
from tests.support.gwworld import connect_tunnel
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcWorld]:
    with open_grpc_world(tmp_path_factory.mktemp("grpcworld")) as world:
        yield world


def via_gateway(gw: GrpcWorld) -> grpc.Channel:
    """A channel through the gateway as a fresh sandbox (proxy URL with its id:token), trusting only
    the gateway's interception CA."""
    return channel(gw.target, gw.gateway_roots(), proxy=gw.proxy_url())


def test_direct_positive_control(gw: GrpcWorld) -> None:
    before = dict(gw.upstream.hits)
    with channel(f"127.0.0.1:{gw.upstream.port}", gw.ca.cert_pem.bytes(), authority=HOST) as ch:
        assert method(ch, "Unary")(b"direct", timeout=10) == b"echo:direct"
        # the method the policy refuses exists: a refusal through the gateway is the gateway's doing
        assert method(ch, "Secret")(b"x", timeout=10) == b"secret:x"
    assert gw.upstream.count("Unary") == before.get("Unary", 0) + 1
    assert gw.upstream.count("Secret") == before.get("Secret", 0) + 1


def test_unary_call_and_its_trailers(gw: GrpcWorld) -> None:
    before = gw.upstream.count("Unary")
    with via_gateway(gw) as ch:
        reply, call = method(ch, "Unary").with_call(b"hello", timeout=15)
    assert reply == b"echo:hello"
    assert call.code() == grpc.StatusCode.OK
    assert ("x-echo-trailer", "kept") in [(m.key, m.value) for m in call.trailing_metadata()]
    assert gw.upstream.count("Unary") == before + 1


def test_server_streaming_1000_messages_in_order(gw: GrpcWorld) -> None:
    with via_gateway(gw) as ch:
        call = method(ch, "Stream", streaming=True)(b"1000", timeout=30)
        got = list(call)
        assert call.code() == grpc.StatusCode.OK
    assert got == [b"%06d" % i for i in range(1000)]


def test_error_status_and_message_reach_the_client_intact(gw: GrpcWorld) -> None:
    before = gw.upstream.count("Fail")
    with via_gateway(gw) as ch, pytest.raises(grpc.RpcError) as info:
        method(ch, "Fail")(b"x", timeout=15)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert info.value.details() == FAIL_MESSAGE
    assert gw.upstream.count("Fail") == before + 1


def test_denied_method_fails_at_the_client_and_never_reaches_the_server(gw: GrpcWorld) -> None:
    before = gw.upstream.count("Secret")
    with via_gateway(gw) as ch, pytest.raises(grpc.RpcError) as info:
        method(ch, "Secret")(b"x", timeout=15)
    shown = f"{info.value.code()}: {info.value.details()!r}"
    # what grpcio shows for the gateway's 403: StatusCode.PERMISSION_DENIED, 'Received http2 header with
    # status: 403' (the JSON reason is in the body, which grpcio does not print)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, shown
    assert "403" in (info.value.details() or ""), shown
    assert gw.upstream.count("Secret") == before, shown

    def records() -> list[dict]:
        return [r for r in gw.gateway.audit_records() if r.get("url.path") == "/egress.test.Echo/Secret"]

    assert wait_for(records), shown
    assert all(r.get("egressgate.decision") == "deny" for r in records()), records()


CHILD = """
import sys, grpc
ch = grpc.secure_channel(sys.argv[1], grpc.ssl_channel_credentials())
try:
    print("OK", ch.unary_unary("/egress.test.Echo/Unary")(b"env", timeout=20).decode())
except grpc.RpcError as e:
    print("ERR", e.code(), e.details())
"""


def test_admission_env_is_all_a_grpc_client_needs(gw: GrpcWorld) -> None:
    """A grpcio process given nothing but what admission hands out (plus PATH): default credentials,
    no channel options. grpcio reads the lowercase `https_proxy` and only GRPC_DEFAULT_SSL_ROOTS_FILE_PATH
    for its roots (before it was in the env: CERTIFICATE_VERIFY_FAILED)."""
    admitted = gw.gateway.admit_sandbox({"policy": "grpc", "labels": {}})
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **admitted["env"]}
    before = gw.upstream.count("Unary")
    done = subprocess.run([sys.executable, "-c", CHILD, gw.target], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "OK echo:env", (done.stdout, done.stderr[-2000:])
    assert gw.upstream.count("Unary") == before + 1


# ----------------------------------------------------------------------------- te, adversarial (raw h2)
@dataclass
class _Identity:
    id: str
    token: str


def h2_request(gw: GrpcWorld, headers: list[tuple[bytes, bytes]], direct: bool = False) -> str:
    """Send one GET with extra `headers` over a fresh HTTP/2 connection (through the gateway's CONNECT
    tunnel, or `direct` to the recorder) with a client that validates nothing; returns how it ended:
    'response 200', 'reset', 'goaway' or 'closed'."""
    authority = f"{H2REC}:{gw.recorder.port}"
    if direct:
        sock = socket.create_connection(("127.0.0.1", gw.recorder.port), timeout=10)
        ctx = ssl.create_default_context(cadata=gw.ca.cert_pem.bytes().decode())
    else:
        admitted = gw.gateway.admit_sandbox({"policy": "grpc", "labels": {}})
        sock, head = connect_tunnel(gw.gateway, _Identity(admitted["id"], admitted["token"]), authority)  # type: ignore[arg-type]
        assert head.startswith(b"HTTP/1.1 200"), head
        ctx = ssl.create_default_context(cafile=gw.gateway.bundle)
    ctx.set_alpn_protocols(["h2"])
    tls = ctx.wrap_socket(sock, server_hostname=H2REC)
    try:
        assert tls.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False,
            validate_inbound_headers=False, header_encoding=None))
        conn.initiate_connection()
        conn.send_headers(1, [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", authority.encode()),
                              (b":path", b"/te"), *headers], end_stream=True)
        tls.sendall(conn.data_to_send())
        tls.settimeout(10)
        while True:
            try:
                data = tls.recv(65536)
            except OSError:
                return "closed"
            if not data:
                return "closed"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    return "response " + dict(event.headers)[b":status"].decode()
                if isinstance(event, h2.events.StreamReset):
                    return "reset"
                if isinstance(event, h2.events.ConnectionTerminated):
                    return "goaway"
            if out := conn.data_to_send():
                tls.sendall(out)
    finally:
        tls.close()


def te_fields(fields: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in fields if k.lower() == b"te"]


def test_recorder_sees_any_te_when_direct(gw: GrpcWorld) -> None:
    """Positive control: without the gateway the recorder sees `te: gzip` as sent, so the tests below
    would see it too if the gateway forwarded it."""
    mark = gw.recorder.mark()
    assert h2_request(gw, [(b"te", b"gzip")], direct=True) == "response 200"
    assert [te_fields(f) for f in gw.recorder.since(mark)] == [[(b"te", b"gzip")]]


@pytest.mark.parametrize("headers", [
    [(b"te", b"trailers")],
    [(b"te", b"TRAILERS")],
    [(b"te", b"trailers"), (b"te", b"trailers")],
])
def test_te_trailers_forwarded_once_exactly(gw: GrpcWorld, headers: list[tuple[bytes, bytes]]) -> None:
    mark = gw.recorder.mark()
    outcome = h2_request(gw, headers)
    seen = gw.recorder.since(mark)
    assert outcome == "response 200" and len(seen) == 1, (outcome, seen)
    assert te_fields(seen[0]) == [(b"te", b"trailers")], seen[0]


@pytest.mark.parametrize("headers", [
    [(b"te", b"gzip")],
    [(b"te", b"trailers, deflate")],
    [(b"te", b"trailers, gzip")],
    [(b"te", b"trailers"), (b"te", b"gzip")],
    [(b"te", b"trailers;q=0.5")],
    [(b"te", b" trailers ")],
    [(b"te", b"trailers"), (b"connection", b"te")],
])
def test_other_te_never_forwarded_on_h2(gw: GrpcWorld, headers: list[tuple[bytes, bytes]]) -> None:
    """Each of these is a malformed HTTP/2 request (RFC 9113 8.2.2): the gateway may refuse it (mitmproxy
    validates inbound headers) or forward it without te; it must never forward anything but `trailers`."""
    mark = gw.recorder.mark()
    outcome = h2_request(gw, headers)
    seen = gw.recorder.since(mark)
    bad = [te_fields(f) for f in seen if te_fields(f) not in ([], [(b"te", b"trailers")])]
    # observed with mitmproxy 12.3.1: GOAWAY for each (h2's inbound validation, before any hook runs);
    # layers/hop_by_hop.py and the upstream side would strip them if that validation were ever off
    assert not bad, (outcome, seen)
