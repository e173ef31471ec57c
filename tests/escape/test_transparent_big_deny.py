"""On the transparent listener too, a refusal reaches the client as the deny contract whatever the body's
size or framing (issue 21 item 2; the explicit proxy's cases are tests/gateway/test_big_body_deny.py).

Clients run unmodified in their own namespace (198.18.21.2) whose TCP is DNATed to the gateway (no proxy
settings): curl (HTTP/1.1 and HTTP/2), requests and httpx. `escape-transparent` allows GET and POST to
api.allowed.test, so a PUT there is refused `method_not_allowed` at its headers: the client reads the
JSON and the upstream never sees the request. Positive controls: the same upload as a POST arrives whole
(HTTP/1.1 over TLS and plain HTTP), and a POST reaches the HTTP/2 upstream.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.escape.checks import requests_on
from tests.networld import World
from tests.support.netgateway import Gateway
from tests.support.transparent import UPSTREAM, Transparent
from tests.support.uploadworld import Upload, curl_upload, python_upload

pytestmark = pytest.mark.netns

NET = "198.18.21"
HOST = "api.allowed.test"
KB, MB = 1024, 1024 * 1024


@pytest.fixture(scope="module")
def tbg(world: World, gateway: Gateway) -> Iterator[Transparent]:
    t = Transparent.create(world, gateway, tag="tbg", net=NET, table="egD_tbigdeny")
    try:
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tbigdeny")


def in_sandbox_curl(tbg: Transparent, work: Path, url: str, size: int, port: int, **kw) -> Upload:
    """curl inside the namespace, the name pinned to the world's upstream address (which the DNAT hands
    to the gateway), trusting the gateway CA."""
    return curl_upload(
        url,
        size,
        work=work,
        cacert=str(tbg.gateway.client_ca),
        prefix=("ip", "netns", "exec", tbg.ns),
        extra=("--resolve", f"{HOST}:{port}:{UPSTREAM}"),
        **kw,
    )


@contextlib.contextmanager
def pinned_name() -> Iterator[None]:
    """`HOST` resolves to the upstream's address for the Python clients (curl's --resolve): the namespace
    has no resolver of its own, and the DNAT sends whatever address to the gateway anyway."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kw):
        return real(UPSTREAM if host == HOST else host, *args, **kw)

    socket.getaddrinfo = getaddrinfo
    try:
        yield
    finally:
        socket.getaddrinfo = real


def in_sandbox_python(tbg: Transparent, url: str, size: int, **kw) -> Upload:
    def run() -> Upload:
        with pinned_name():
            return python_upload(url, size, cafile=str(tbg.gateway.client_ca), **kw)

    return tbg.in_tsb(run)


def assert_refused(tbg: Transparent, up: Upload, reason: str = "method_not_allowed") -> None:
    doc = up.deny()
    assert up.status == 403 and doc["reason"] == reason, str(up)
    record = tbg.gateway.audit_record(doc["request_id"])
    assert record["egressgate.mode"] == "transparent" and record["egressgate.sandbox.id"] == tbg.sbx.id, record


def untouched(world: World, mark) -> None:
    for listener in ("upstream-tls", "upstream-http", "upstream-h2"):
        assert requests_on(world, mark, listener) == [], listener


@pytest.mark.parametrize("expect", [None, False], ids=["expect-default", "no-expect"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", [64 * KB, 20 * MB], ids=["64KB", "20MB"])
def test_curl_https_denied_upload_gets_the_json(
    tbg: Transparent, world: World, work: Path, size: int, chunked: bool, expect
) -> None:
    mark = world.mark()
    up = in_sandbox_curl(tbg, work, f"https://{HOST}/upload", size, 443, method="PUT", chunked=chunked, expect=expect)
    assert_refused(tbg, up)
    assert "rc=0" in up.error, str(up)
    untouched(world, mark)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_curl_https_allowed_upload_arrives(tbg: Transparent, world: World, work: Path, chunked: bool) -> None:
    mark = world.mark()
    up = in_sandbox_curl(tbg, work, f"https://{HOST}/upload", 20 * MB, 443, chunked=chunked)
    assert up.status == 200, str(up)
    assert [r["body_len"] for r in requests_on(world, mark, "upstream-tls")] == [20 * MB]


def test_curl_plain_http_denied_and_allowed(tbg: Transparent, world: World, work: Path) -> None:
    """Plain HTTP: the only rule for port 80 allows any method on api.allowed.test, so the refusal here
    is other.allowed.test's (allowed on 443 only: `port_not_allowed`); control: the same upload to
    api.allowed.test."""
    mark = world.mark()
    up = curl_upload(
        "http://other.allowed.test/upload",
        20 * MB,
        work=work,
        cacert=str(tbg.gateway.client_ca),
        prefix=("ip", "netns", "exec", tbg.ns),
        extra=("--resolve", f"other.allowed.test:80:{UPSTREAM}"),
        chunked=True,
    )
    doc = up.deny()
    assert up.status == 403, str(up)
    untouched(world, mark)
    assert doc["reason"] == "port_not_allowed", doc
    up = in_sandbox_curl(tbg, work, f"http://{HOST}/upload", 20 * MB, 80, chunked=True)
    assert up.status == 200, str(up)
    assert [r["body_len"] for r in requests_on(world, mark, "upstream-http")] == [20 * MB]


@pytest.mark.parametrize("size", [KB, 20 * MB], ids=["1KB", "20MB"])
def test_curl_http2_denied_upload_gets_the_json(tbg: Transparent, world: World, work: Path, size: int) -> None:
    mark = world.mark()
    up = in_sandbox_curl(tbg, work, f"https://{HOST}:9443/upload", size, 9443, method="PUT", http2=True)
    assert_refused(tbg, up)
    assert "rc=0" in up.error, str(up)
    untouched(world, mark)
    # control: a POST on the same HTTP/2 route reaches the upstream (which answers at its headers)
    up = in_sandbox_curl(tbg, work, f"https://{HOST}:9443/upload", KB, 9443, http2=True)
    assert up.status == 200 and json.loads(up.body)["listener"] == "upstream-h2", str(up)


@pytest.mark.parametrize("client", ["requests", "httpx"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_python_clients_denied_upload_get_the_json(tbg: Transparent, world: World, client: str, chunked: bool) -> None:
    mark = world.mark()
    up = in_sandbox_python(tbg, f"https://{HOST}/upload", 20 * MB, client=client, method="PUT", chunked=chunked)
    assert_refused(tbg, up)
    untouched(world, mark)
    mark = world.mark()
    up = in_sandbox_python(tbg, f"https://{HOST}/upload", 20 * MB, client=client, chunked=chunked)
    assert up.status == 200, str(up)
    assert [r["body_len"] for r in requests_on(world, mark, "upstream-tls")] == [20 * MB]


def test_httpx_http2_denied_upload_gets_the_json(tbg: Transparent, world: World) -> None:
    mark = world.mark()
    up = in_sandbox_python(tbg, f"https://{HOST}:9443/upload", 20 * MB, client="httpx2", method="PUT")
    assert_refused(tbg, up)
    untouched(world, mark)
