"""Trailers and 1xx responses through the real gateway (issue 9, items 4 and 8).

Request trailers are refused (`trailers_not_allowed`) on every route: an HTTP/1 chunked request with a
trailer section, HTTP/2 trailers (48 kB over a 20 kB budget, a phantom placeholder in a trailer), buffered
or streamed. Response trailers are forwarded to HTTP/1 clients in the chunked terminator and scrubbed on
credentialed routes. A `103 Early Hints` before the real response is swallowed: the client gets the 200.

The upstreams (trailer_peers.py) record everything they receive, including trailers and whether the
request completed; the positive controls send the same requests straight to them, proving they would
have seen (and reflected) what the gateway must stop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import ssl
import time
from collections.abc import Iterator

import pytest
import yaml

from tests.gateway_credentials.trailer_peers import (
    BIG_TRAILERS,
    TWorld,
    chunked_request,
    deny_reason,
    h1_exchange,
    h2_exchange,
    proxy_auth,
    proxy_plain,
    records_for,
    serve_h1,
    serve_h2,
    settle,
    tunnel_tls,
)
from tests.support.bao import KV_SECRET
from tests.support.credworld import World, launch
from tests.support.loopback import Hits
from tests.support.replay_check import stop_and_replay

BUDGET = 20000
HOSTS = ("trailers.test", "credtrail.test", "phtrail.test")


@pytest.fixture(scope="module")
def tw(cworld: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TWorld]:
    tmp = tmp_path_factory.mktemp("trailers")
    cert = cworld.ca.issue_cert(*HOSTS)
    hits = Hits()
    servers: list = []

    async def start() -> tuple[int, ...]:
        h1ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(h1ctx)
        h1ctx.set_alpn_protocols(["http/1.1"])
        h2ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(h2ctx)
        h2ctx.set_alpn_protocols(["h2"])
        s1 = await asyncio.start_server(lambda r, w: serve_h1(r, w, hits), "127.0.0.1", 0, ssl=h1ctx)
        s2 = await asyncio.start_server(lambda r, w: serve_h1(r, w, hits), "127.0.0.1", 0)  # plain HTTP
        s3 = await asyncio.start_server(lambda r, w: serve_h2(r, w, hits), "127.0.0.1", 0, ssl=h2ctx)
        servers.extend([s1, s2, s3])
        return tuple(s.sockets[0].getsockname()[1] for s in (s1, s2, s3))

    h1_port, plain_port, h2_port = cworld.loop.run(start())
    for host in HOSTS:
        cworld.dns.records[host] = "127.0.0.1"
    secret_file = tmp / "kv-secret"
    secret_file.write_text(KV_SECRET + "\n")
    os.chmod(secret_file, 0o600)
    static = {"type": "static", "source": {"file": str(secret_file)}, "ttl_seconds": 300}
    ports = [h1_port, h2_port]
    policy = {
        "sandbox": {"name": "trailers", "resources": {"outbound_bytes_max": BUDGET}},
        "network": {"allow_private": ["127.0.0.1/32"], "https": {"allow": [
            {"id": "plain", "host": "trailers.test", "ports": ports},
            {"id": "cred", "host": "credtrail.test", "ports": ports, "credential": "kv"},
            {"id": "phantom", "host": "phtrail.test", "ports": ports, "credential": "openai"},
        ]}, "http": {"allow": [{"id": "plain-http", "host": "trailers.test", "ports": [plain_port]}]}},
        "credentials": {"max_ttl_seconds": 120, "capabilities": {
            "kv": static,
            "openai": {**static, "mode": "phantom", "phantom_env": "OPENAI_API_KEY",
                       "placement": {"header": "Authorization", "format": "Bearer {value}"}}}},
    }
    (tmp / "policies").mkdir()
    (tmp / "policies" / "trailers.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
    gw = launch(cworld, tmp, None, broker={}, file_secret=str(secret_file))
    try:
        yield TWorld(gw=gw, hits=hits, h1_port=h1_port, h2_port=h2_port, plain_port=plain_port,
                     ca_pem=str(tmp / "upstream-ca.pem"))
    finally:
        stop_and_replay(gw)  # type: ignore[arg-type]

        async def stop() -> None:
            for server in servers:
                server.close()
        cworld.loop.run(stop())


# --------------------------------------------------------------------------------------- request trailers, HTTP/1
def test_h1_chunked_request_trailers_refused(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    request = chunked_request("trailers.test", "/upload", b"hello", ["X-Exfil: secret-data", "X-More: 2"])
    # positive control: straight to the upstream, the trailers arrive
    mark = tw.hits.mark()
    direct = h1_exchange(tunnel_tls(tw, None, "trailers.test", tw.h1_port, "http/1.1"), request)
    assert direct.status == 200
    assert tw.hits.since(mark)[-1]["trailers"] == [("x-exfil", "secret-data"), ("x-more", "2")]
    # through the gateway: a deny the client sees, and the upstream never gets a complete request
    mark = tw.hits.mark()
    res = h1_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1"), request)
    assert res.status == 403, res
    assert res.headers.get("x-egressgate-decision") == "deny"
    assert deny_reason(res.body) == "trailers_not_allowed", res.body
    settle()
    seen = tw.hits.since(mark)
    assert all(not r.get("complete") and not r["trailers"] for r in seen), seen
    denies = [r for r in records_for(tw.gw, sbx) if r.get("egressgate.reason") == "trailers_not_allowed"]
    assert len(denies) == 1 and denies[0]["egressgate.decision"] == "deny"
    assert "secret-data" not in tw.gw.audit_text()


def test_h1_chunked_request_without_trailers_still_passes(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    res = h1_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1"),
                      chunked_request("trailers.test", "/upload", b"hello", []))
    assert res.status == 200 and json.loads(res.body)["body_len"] == 5, res
    settle()
    assert [r["complete"] for r in tw.hits.since(mark)] == [True]


@pytest.mark.parametrize("piecewise", [False, True])
def test_h1_oversized_trailer_section_is_a_clean_error(tw: TWorld, piecewise: bool) -> None:
    """A trailer block past 64 KiB is neither buffered nor forwarded: whether it arrives in one read or
    trickles in, the client gets a 400 (never a hang) and the upstream never sees the request complete."""
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    lines = [f"X-Fill-{i}: {'B' * 1000}" for i in range(80)]
    request = chunked_request("trailers.test", "/upload", b"hello", lines)
    tls = tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1")
    if piecewise:
        with contextlib.suppress(OSError):  # the gateway answers and closes before the end arrives
            for i in range(0, len(request) - 8000, 8000):
                tls.sendall(request[i:i + 8000])
                time.sleep(0.02)
        request = b""
    res = h1_exchange(tls, request)
    assert res.status == 400 and b"trailer section larger than" in res.body, res
    settle()
    assert all(not r.get("complete") for r in tw.hits.since(mark))


def test_h1_trailers_refused_on_plain_http_through_the_explicit_proxy(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    target = f"http://trailers.test:{tw.plain_port}/upload"
    request = chunked_request("trailers.test", target, b"hello", ["X-Exfil: plain"])
    request = request.replace(b"\r\nHost:", f"\r\n{proxy_auth(sbx)}\r\nHost:".encode(), 1)
    mark = tw.hits.mark()
    res = h1_exchange(proxy_plain(tw, sbx), request)
    assert res.status == 403 and deny_reason(res.body) == "trailers_not_allowed", res
    settle()
    assert all(not r.get("complete") and not r["trailers"] for r in tw.hits.since(mark))
    # positive control: without trailers the same request is forwarded
    res = h1_exchange(proxy_plain(tw, sbx), chunked_request("trailers.test", target, b"hello", []).replace(
        b"\r\nHost:", f"\r\n{proxy_auth(sbx)}\r\nHost:".encode(), 1))
    assert res.status == 200 and json.loads(res.body)["body_len"] == 5, res


def test_h1_trailers_after_an_early_upstream_answer_never_reach_it(tw: TWorld) -> None:
    """The upstream answers before the body ends; the trailers that follow are still refused (audited)
    and never forwarded: the request is reset rather than completed."""
    sbx = tw.gw.admit("trailers")
    head = (b"POST /early-answer HTTP/1.1\r\nHost: trailers.test\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n")
    tls = tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1")
    mark = tw.hits.mark()
    tls.sendall(head)
    time.sleep(0.5)  # the upstream's early answer is on its way to the client
    with contextlib.suppress(OSError):
        tls.sendall(b"0\r\nX-Exfil: late\r\n\r\n")
    with contextlib.suppress(OSError, TimeoutError):
        tls.recv(65536)
    deadline = time.monotonic() + 5
    while not tw.hits.since(mark) and time.monotonic() < deadline:  # recorded when the upstream sees the cut
        time.sleep(0.05)
    seen = tw.hits.since(mark)
    assert [(r["body_len"], r["complete"], r["trailers"]) for r in seen] == [(5, False, [])], seen  # cut, not completed
    assert any(r.get("egressgate.reason") == "trailers_not_allowed" for r in records_for(tw.gw, sbx))


# --------------------------------------------------------------------------------------- request trailers, HTTP/2
def test_h2_trailers_48k_over_budget_refused(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    # positive control: straight to the upstream, 48 kB of trailers arrive
    mark = tw.hits.mark()
    direct = h2_exchange(tunnel_tls(tw, None, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                         b"hello", BIG_TRAILERS)
    assert direct.status == 200
    assert sum(len(v) for _k, v in tw.hits.since(mark)[-1]["trailers"]) == 48000
    mark = tw.hits.mark()
    res = h2_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                      b"hello", BIG_TRAILERS)
    assert res.status == 403 and deny_reason(res.body) == "trailers_not_allowed", res
    settle()
    seen = tw.hits.since(mark)
    assert all(not r["complete"] and not r["trailers"] for r in seen), seen


def test_h2_phantom_in_trailer_refused(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    phantom = sbx["env"]["OPENAI_API_KEY"]
    assert phantom.startswith("egph_")
    trailers = [("authorization", f"Bearer {phantom}"), ("x-note", phantom)]
    mark = tw.hits.mark()
    res = h2_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                      b"payload", trailers)
    assert res.status == 403 and deny_reason(res.body) == "trailers_not_allowed", res
    settle()
    seen = tw.hits.since(mark)
    assert all(phantom not in repr(r) and not r["complete"] for r in seen), seen
    assert phantom not in tw.gw.audit_text()
    # positive control: the same phantom as the bound header on its own route is swapped and passes
    mark = tw.hits.mark()
    ok = h2_exchange(tunnel_tls(tw, sbx, "phtrail.test", tw.h2_port, "h2"), "phtrail.test", "/echo")
    assert ok.status == 200, ok
    assert tw.hits.since(mark)[-1]["complete"]


def test_h2_buffered_body_with_trailers_refused_and_refunded(tw: TWorld) -> None:
    """Content-Length <= 64 KiB: the body is buffered, nothing goes upstream, the prepaid bytes return."""
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    res = h2_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                      b"x" * 3000, [("x-exfil", "1")], content_length=True)
    assert res.status == 403 and deny_reason(res.body) == "trailers_not_allowed", res
    settle()
    assert tw.hits.since(mark) == []
    # positive control, and the refund: 17 kB more only fit the 20 kB budget if the refused 3 kB came back
    res = h2_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h2_port, "h2"), "trailers.test", "/upload",
                      b"x" * 17000, None, content_length=True)
    assert res.status == 200 and json.loads(res.body)["body_len"] == 17000, res


# --------------------------------------------------------------------------------------- response trailers
def test_h1_response_trailers_forwarded(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    res = h1_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1"),
                      b"GET /resp-trailers HTTP/1.1\r\nHost: trailers.test\r\n\r\n")
    assert res.status == 200 and res.body == b"body-before-trailers", res
    assert res.trailers.get("x-plain") == "ok", res


def test_h1_response_trailer_echoing_credential_is_scrubbed(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    res = h1_exchange(tunnel_tls(tw, sbx, "credtrail.test", tw.h1_port, "http/1.1"),
                      b"GET /resp-trailers HTTP/1.1\r\nHost: credtrail.test\r\n\r\n")
    # positive control: the upstream got the credential, so its trailers did carry it
    assert (b"authorization", f"Bearer {KV_SECRET}".encode()) in tw.hits.since(mark)[-1]["headers"]
    assert res.status == 200 and res.body == b"body-before-trailers", res
    assert res.trailers.get("x-plain") == "ok" and "x-echo" in res.trailers, res
    for form in (KV_SECRET, base64.b64encode(KV_SECRET.encode()).decode().rstrip("=")):
        assert form.encode() not in res.raw, res.trailers


def test_h2_response_trailer_echoing_credential_is_scrubbed(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    mark = tw.hits.mark()
    res = h2_exchange(tunnel_tls(tw, sbx, "credtrail.test", tw.h2_port, "h2"), "credtrail.test", "/resp-trailers")
    assert any(v == f"Bearer {KV_SECRET}" for _k, v in tw.hits.since(mark)[-1]["headers"])
    assert res.status == 200 and res.trailers.get("x-plain") == "ok", res
    assert KV_SECRET not in repr(res.trailers), res.trailers


# --------------------------------------------------------------------------------------- 1xx
def test_early_hints_then_final_response(tw: TWorld) -> None:
    request = b"GET /early-hints HTTP/1.1\r\nHost: trailers.test\r\n\r\n"
    # positive control: the upstream really sends a 103 before the 200
    direct = h1_exchange(tunnel_tls(tw, None, "trailers.test", tw.h1_port, "http/1.1"), request)
    assert direct.informational == [103] and direct.status == 200
    sbx = tw.gw.admit("trailers")
    tls = tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1")
    res = h1_exchange(tls, request)
    assert res.status == 200 and res.body == b"final", res
    # the connection stays usable for the next request
    again = h1_exchange(tls, b"GET /echo HTTP/1.1\r\nHost: trailers.test\r\n\r\n")
    assert again.status == 200, again


def test_early_hints_over_plain_http_through_the_explicit_proxy(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    target = f"http://trailers.test:{tw.plain_port}/early-hints"
    direct = h1_exchange(proxy_plain(tw, None), b"GET /early-hints HTTP/1.1\r\nHost: trailers.test\r\n\r\n")
    assert direct.informational == [103] and direct.status == 200
    res = h1_exchange(proxy_plain(tw, sbx),
                      f"GET {target} HTTP/1.1\r\nHost: trailers.test\r\n{proxy_auth(sbx)}\r\n\r\n".encode())
    assert res.status == 200 and res.body == b"final" and res.informational == [], res


def test_endless_informational_responses_end_in_502(tw: TWorld) -> None:
    sbx = tw.gw.admit("trailers")
    res = h1_exchange(tunnel_tls(tw, sbx, "trailers.test", tw.h1_port, "http/1.1"),
                      b"GET /many-1xx HTTP/1.1\r\nHost: trailers.test\r\n\r\n")
    assert res.status == 502, res
