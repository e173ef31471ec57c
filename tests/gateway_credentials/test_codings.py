"""Every response coding on a credentialed route is decoded and scrubbed, or refused (issue 9 item 1).

A raw TLS upstream (rawcodings.py) echoes the injected credential compressed under Transfer-Encoding
(`gzip, chunked`, `gzip`, `deflate`, ...), Content-Encoding (gzip, deflate zlib/raw, br, zstd, nested,
two fields, case variants), both at once, or codings nobody here can decode. Through the real gateway
the sandbox must get either the scrubbed plaintext with headers that describe it, or a 502 that says
why (audited). Positive controls, per case: the bytes the upstream sent hold the secret under that
coding (so the detector can find it), and the same answer through a route without a credential
reaches the client with the secret intact (so a leak would have been seen).
"""

from __future__ import annotations

import base64
import gzip
import json
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import yaml

from tests.gateway_credentials.rawcodings import (
    DECODED,
    MALFORMED,
    MITM_REFUSED,
    REFUSED,
    RawUpstream,
    dechunk,
    leak_in,
)
from tests.support.bao import KV_SECRET, BaoServer
from tests.support.credworld import KV, MAX_TTL, Gateway, World, launch
from tests.support.replay_check import stop_and_replay

EXPECTED = b"x" * 300 + b"[[REDACTED]][REDACTED]" + b"y" * 300  # payload(secret), scrubbed


@dataclass
class Env:
    gw: Gateway
    up: RawUpstream
    sbx: dict


@pytest.fixture(scope="module")
def env(cworld: World, cbao: BaoServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cert = cworld.ca.issue_cert("api.test")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    h2ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(h2ctx)
    h2ctx.set_alpn_protocols(["h2"])
    up = RawUpstream()
    cworld.loop.run(up.start(ctx, h2ctx))
    tmp = tmp_path_factory.mktemp("codings")
    (tmp / "policies").mkdir()
    ports = [up.port, up.h2_port]
    doc = {"sandbox": {"name": "cred-codings"},
           "network": {"allow_private": ["127.0.0.1/32"], "https": {"allow": [
               {"id": "codings-cred", "host": "api.test", "ports": ports, "methods": ["GET", "HEAD"],
                "paths": ["/cred/*"], "credential": "kv"},
               {"id": "codings-open", "host": "api.test", "ports": ports, "methods": ["GET", "HEAD"],
                "paths": ["/open/*"]}]}},
           "credentials": {"max_ttl_seconds": MAX_TTL,
                           "capabilities": {"kv": {"type": "static", "source": KV, "ttl_seconds": 300}}}}
    (tmp / "policies" / "cred-codings.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    gw = launch(cworld, tmp, cbao)
    try:
        yield Env(gw, up, gw.admit("cred-codings"))
    finally:
        stop_and_replay(gw)  # type: ignore[arg-type]
        cworld.loop.run(up.stop())


def fetch(env: Env, path: str, *, method: str = "GET", version: str = "HTTP/1.1", port: int | None = None) -> bytes:
    """Everything the sandbox receives for one request (raw bytes, read until the gateway closes)."""
    port = port or env.up.port
    sock = socket.create_connection(env.gw.proxy, timeout=15)
    auth = base64.b64encode(f"{env.sbx['id']}:{env.sbx['token']}".encode()).decode()
    sock.sendall(f"CONNECT api.test:{port} HTTP/1.1\r\nHost: api.test:{port}\r\n"
                 f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    tls = ssl.create_default_context(cafile=env.gw.bundle).wrap_socket(sock, server_hostname="api.test")
    echo = f"X-Echo: {KV_SECRET}\r\n" if "/open/" in path else ""
    tls.sendall(f"{method} {path} {version}\r\nHost: api.test:{port}\r\nAccept-Encoding: gzip, br, zstd\r\n"
                f"{echo}Connection: close\r\n\r\n".encode())
    data = b""
    try:
        while chunk := tls.recv(65536):
            data += chunk
    except (ssl.SSLError, ConnectionError, TimeoutError):
        pass
    finally:
        tls.close()
    return data


def parse(raw: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
    return int(lines[0].split()[1]), headers, body


def header(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in headers if k == name]


def sent_for(env: Env, path: str):
    got = [s for s in env.up.sent if s.path == path]
    assert got, f"the upstream never answered {path}"
    return got[-1]


def outcome(env: Env, raw: bytes) -> dict:
    """The outcome record of the response in `raw` (by the request id the gateway put on it)."""
    rid = header(parse(raw)[1], "x-egressgate-request-id")[0]
    for _ in range(50):
        recs = [r for r in env.gw.audit_records()
                if r.get("egressgate.operation") == "outcome" and r.get("egressgate.request.id") == rid]
        if recs:
            return recs[-1]
        time.sleep(0.1)
    raise AssertionError(f"no outcome record for {rid}")


def control(env: Env, name: str, *, passes: bool = True) -> None:
    """Positive controls: the upstream really sent the secret under this coding, and (when mitmproxy
    passes it at all) a route without a credential delivers it to the client, where leak_in finds it."""
    assert leak_in(sent_for(env, f"/cred/{name}").data, KV_SECRET), name
    assert sent_for(env, f"/cred/{name}").secret == KV_SECRET  # the gateway injected it; the echo had it
    raw = fetch(env, f"/open/{name}")
    assert leak_in(sent_for(env, f"/open/{name}").data, KV_SECRET)
    assert leak_in(raw, KV_SECRET) is passes, (name, raw[:400])


@pytest.mark.parametrize("name", sorted(DECODED))
def test_coded_echo_is_decoded_and_scrubbed(env: Env, name: str) -> None:
    raw = fetch(env, f"/cred/{name}")
    assert not leak_in(raw, KV_SECRET), (name, raw[:400])
    status, headers, body = parse(raw)
    assert status == 200, raw[:400]
    # the client gets a consistent message: plaintext, no coding left to undo, one framing
    assert set(header(headers, "content-encoding")) <= {"identity"}, headers
    assert header(headers, "transfer-encoding") in ([], ["chunked"]), headers
    if header(headers, "transfer-encoding"):
        assert header(headers, "content-length") == [] and body.endswith(b"0\r\n\r\n")
        body = dechunk(body)
    elif header(headers, "content-length"):
        assert int(header(headers, "content-length")[0]) == len(body)
    assert body == EXPECTED, (name, body[:200])
    control(env, name)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_undecodable_coding_is_refused_and_audited(env: Env, name: str) -> None:
    raw = fetch(env, f"/cred/{name}")
    assert not leak_in(raw, KV_SECRET), (name, raw[:400])
    status, headers, body = parse(raw)
    assert status == 502, raw[:400]
    assert int(header(headers, "content-length")[0]) == len(body)
    doc = json.loads(body)
    assert doc["error"] == "upstream_response_refused" and doc["reason"] == "unsupported_coding"
    assert "coding" in doc["message"] and doc["request_id"]
    rec = outcome(env, raw)
    assert rec["egressgate.request.id"] == doc["request_id"] and str(rec["http.response.status_code"]) == "502"
    assert rec["egressgate.response_refused"] == "unsupported_coding"
    control(env, name)


@pytest.mark.parametrize("name", sorted(MITM_REFUSED))
def test_framing_mitmproxy_rejects_never_reaches_the_client(env: Env, name: str) -> None:
    """Unknown transfer codings, duplicate Transfer-Encoding fields, TE with Content-Length: mitmproxy
    refuses them before any hook; its 502 page would quote the header, so on a credentialed route the
    connection is cut instead (see the malformed-head test). The controls as for the other cases."""
    raw = fetch(env, f"/cred/{name}")
    assert not leak_in(raw, KV_SECRET)
    assert raw == b"" or parse(raw)[0] == 502, raw[:300]
    control(env, name, passes=False)


def test_bombs_and_corrupt_bodies_never_reach_the_client(env: Env) -> None:
    """Buffered: a body that inflates past the 16 MiB cap is refused whole (502). Streamed: corrupt
    data cuts the connection mid-body; what went out before holds no part of the echo. Both audited."""
    raw = fetch(env, "/cred/bomb")
    status, _, body = parse(raw)
    assert status == 502 and json.loads(body)["reason"] == "undecodable_body" and not leak_in(raw, KV_SECRET)
    assert outcome(env, raw)["egressgate.response_refused"] == "undecodable_body"
    assert leak_in(sent_for(env, "/cred/bomb").data, KV_SECRET)  # control: the upstream echoed it
    raw = fetch(env, "/cred/corrupt-chunked")
    status, _, body = parse(raw)
    assert status == 200 and not body.endswith(b"0\r\n\r\n"), raw[-100:]  # cut, not completed
    half = len(KV_SECRET) // 2
    assert not leak_in(raw, KV_SECRET) and KV_SECRET[:half].encode() not in raw
    assert set(dechunk(body)) <= set(b"x")  # at most the clean first member; cut at the garbage
    assert outcome(env, raw)["egressgate.response_refused"] == "undecodable_body"
    sent = parse(sent_for(env, "/cred/corrupt-chunked").data)[2]  # control: behind the garbage, the echo
    assert KV_SECRET.encode() in gzip.decompress(dechunk(sent).replace(b"\xff" * 64, b""))


def test_http10_client_gets_the_decoded_body_close_delimited(env: Env) -> None:
    raw = fetch(env, "/cred/te-gzip-chunked", version="HTTP/1.0")
    assert not leak_in(raw, KV_SECRET)
    status, headers, body = parse(raw)
    assert status == 200 and header(headers, "transfer-encoding") == [] and body == EXPECTED


def test_keepalive_after_decoded_responses(env: Env) -> None:
    """httpx on one HTTP/1.1 connection: every rewritten response is framed right, the next one works."""
    names = ["te-gzip-chunked", "ce-gzip", "te-deflate-raw-chunked", "ce-br-gzip-chunked", "te-gzip-over-ce-br",
             "ce-zstd"]
    with httpx.Client(proxy=env.sbx["proxy_url"], verify=ssl.create_default_context(cafile=env.gw.bundle),
                      timeout=15, trust_env=False) as c:
        for name in names * 2:
            r = c.get(f"https://api.test:{env.up.port}/cred/{name}")
            assert r.status_code == 200 and r.content == EXPECTED, (name, r.content[:100])


def test_bodiless_responses_carry_no_coded_body(env: Env) -> None:
    raw = fetch(env, "/cred/te-gzip-chunked", method="HEAD")
    assert not leak_in(raw, KV_SECRET) and parse(raw)[0] == 200 and parse(raw)[2] == b""
    for name in ("no-content", "not-modified"):
        raw = fetch(env, f"/cred/{name}")
        assert not leak_in(raw, KV_SECRET), name
        assert KV_SECRET.encode() not in raw


def test_folded_header_echo_is_refused(env: Env) -> None:
    """An echo split by an obsolete line fold is invisible to the scrubber; a client unfolds it."""
    raw = fetch(env, "/cred/fold")
    half = len(KV_SECRET) // 2
    assert KV_SECRET[half:].encode() not in raw and KV_SECRET[:half].encode() not in raw, raw[:400]
    status, _, body = parse(raw)
    assert status == 502 and json.loads(body)["reason"] == "folded_header"
    assert outcome(env, raw)["egressgate.response_refused"] == "folded_header"
    # control: without a credential the fold reaches the client, which reads both halves
    opened = fetch(env, "/open/fold")
    assert parse(opened)[0] == 200
    assert KV_SECRET.encode() in opened.replace(b"\r\n ", b"")


def h2_raw(env: Env, path: str) -> tuple[int, dict, bytes]:
    """An HTTP/2 client (the gateway speaks h2 to it because the upstream does): status, headers and the
    body exactly as received (httpx does not decode it)."""
    with httpx.Client(proxy=env.sbx["proxy_url"], verify=ssl.create_default_context(cafile=env.gw.bundle),
                      timeout=15, trust_env=False, http1=False, http2=True) as c:
        echo = {"X-Echo": KV_SECRET} if "/open/" in path else {}
        with c.stream("GET", f"https://api.test:{env.up.h2_port}{path}", headers=echo) as r:
            assert r.http_version == "HTTP/2"
            return r.status_code, dict(r.headers), b"".join(r.iter_raw())


def test_http2_upstream_transfer_encoding_never_leaks(env: Env) -> None:
    """Transfer-Encoding is forbidden in HTTP/2 (RFC 9113 8.2.2): the response is refused (by h2 in
    mitmproxy, and by response_codings.py if that ever let it through). A legal nested
    Content-Encoding over HTTP/2 is decoded; through the uncredentialed route it arrives coded."""
    try:
        status, headers, body = h2_raw(env, "/cred/te-gzip")
    except httpx.RemoteProtocolError:  # cut: mitmproxy's error page would quote the header
        status, headers, body = 0, {}, b""
    assert status in (0, 502) and not leak_in(repr(headers).encode() + body, KV_SECRET), (status, body[:200])
    assert leak_in(sent_for(env, "/cred/te-gzip").data, KV_SECRET)  # control: it was sent
    status, headers, body = h2_raw(env, "/cred/ce-gzip-br")
    assert status == 200 and "content-encoding" not in headers and "transfer-encoding" not in headers
    assert body == EXPECTED
    status, headers, body = h2_raw(env, "/open/ce-gzip-br")  # control
    assert status == 200 and headers["content-encoding"] == "gzip, br" and leak_in(body, KV_SECRET)


def test_malformed_head_quoting_the_echo_never_reaches_client_or_audit(env: Env) -> None:
    """mitmproxy answers a head it cannot parse with a 502 page quoting the bad bytes, and puts them in
    flow.error (audited). On a credentialed route the sandbox gets a cut connection instead, and the
    audit record a sanitized message; the control shows the page really quotes the echo."""
    audit_before = len(env.gw.audit_text())
    for name in sorted(MALFORMED):
        raw = fetch(env, f"/cred/{name}")
        assert KV_SECRET.encode() not in raw and not leak_in(raw, KV_SECRET), (name, raw[:300])
        assert raw == b"", (name, raw[:300])  # cut before mitmproxy's page went out
        assert sent_for(env, f"/cred/{name}").secret == KV_SECRET  # the echo was sent
    time.sleep(0.5)
    assert KV_SECRET not in env.gw.audit_text()[audit_before:]
    records = env.gw.audit_records()
    for name in sorted(MALFORMED):
        rid = [r for r in records if r.get("url.path") == f"/cred/{name}"][-1]["egressgate.request.id"]
        out = [r for r in records if r.get("egressgate.operation") == "outcome" and r["egressgate.request.id"] == rid]
        assert out and out[-1]["egressgate.response_refused"] == "malformed_response", name
        assert "<upstream bytes>" in out[-1]["egressgate.error"], out[-1]
    # controls: the same heads through the route without a credential: mitmproxy's page quotes the echo
    for name in sorted(MALFORMED):
        raw = fetch(env, f"/open/{name}")
        assert raw.startswith(b"HTTP/1.1 502") and KV_SECRET.encode() in raw, (name, raw[:300])
