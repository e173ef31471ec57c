"""Package installs (`execution.package_install`) on the transparent listener: a sandbox with no proxy
settings is classified like one behind the explicit proxy (docs/policy.md, "Package installs").

`tpk` (198.18.22.0/24) has its TCP DNATed to the gateway's transparent listener. Each test sends the same
package request twice from two source addresses there: one admitted under escape-transparent
(package_install: the default deny) and one under escape-transparent-packages (`allow`, same rules). The
`allow` sandbox's request reaching the world's upstream is the positive control: the deny is the class
check and nothing else, and the upstream would have served it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tests.networld as nw
from tests.escape.checks import requests_on
from tests.networld import World
from tests.support.netgateway import Gateway
from tests.support.transparent import UPSTREAM, Transparent

pytestmark = pytest.mark.netns

NET = "198.18.22"  # this module's transparent namespace (other modules: .5 .6 .7 .9 .12-.15 .21)
DENY_SOURCE, ALLOW_SOURCE = f"{NET}.2", f"{NET}.10"  # .2: create() admits escape-transparent there
HOST = "api.allowed.test"

# (path, protocol the gateway names in egressgate.operation.protocol) — a PEP 503 index page, a wheel,
# a versioned sdist, an npm tarball, a Go module zip, and the same wheel hidden behind encodings
PACKAGE_PATHS = [
    "/simple/requests/",
    "/packages/requests-2.32.3-py3-none-any.whl",
    "/files/pkg-1.0.tar.gz",
    "/left-pad/-/left-pad-1.3.0.tgz",
    "/golang.org/x/net/@v/v0.1.0.zip",
    "/packages//requests-2.32.3-py3-none-any%2Ewhl",
    "/SIMPLE/Requests/;x=1",
]


@pytest.fixture(scope="module")
def tpk(world: World, gateway: Gateway) -> Iterator[Transparent]:
    t = Transparent.create(world, gateway, tag="tpk", net=NET, table="egP_tpkg")
    nw.sh("ip", "-n", t.ns, "addr", "add", f"{ALLOW_SOURCE}/32", "dev", f"{nw.PREFIX}{world.sid}tpkb")
    gateway.admit("escape-transparent-packages", address=ALLOW_SOURCE)
    try:
        yield t
    finally:
        t.close()


def fetch(tpk: Transparent, scheme: str, path: str, source: str):
    if scheme == "https":
        return tpk.https(UPSTREAM, HOST, HOST, path=path, source=source)
    return tpk.http(UPSTREAM, HOST, path=path, source=source)


@pytest.mark.parametrize("scheme", ["https", "http"])
@pytest.mark.parametrize("path", PACKAGE_PATHS)
def test_a_package_request_is_refused_under_the_default_deny_and_passes_under_allow(
        tpk: Transparent, world: World, gateway: Gateway, scheme: str, path: str):
    hits = f"upstream-{'tls' if scheme == 'https' else 'http'}"
    mark = world.mark()
    resp = fetch(tpk, scheme, path, DENY_SOURCE)
    assert resp.status == 403, resp.raw[:400]
    body = resp.json()
    assert body["reason"] == "package_install_denied", body
    record = gateway.audit_record(body["request_id"])
    assert record["egressgate.mode"] == "transparent"
    assert record["egressgate.reason"] == "package_install_denied"
    assert record["egressgate.operation.class"] == "package_install"
    assert requests_on(world, mark, hits) == [], "a refused package request reached the upstream"

    # the control: the same request from the `allow` sandbox is served by the upstream
    mark = world.mark()
    resp = fetch(tpk, scheme, path, ALLOW_SOURCE)
    assert resp.status == 200, resp.raw[:400]
    record = gateway.audit_record(resp.headers["x-egressgate-request-id"])
    assert record["egressgate.decision"] == "allow" and record["egressgate.mode"] == "transparent"
    assert record["egressgate.operation.class"] == "package_install"
    assert len(requests_on(world, mark, hits)) == 1


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_an_ordinary_request_is_not_a_package_install(tpk: Transparent, world: World, scheme: str):
    """The deny sandbox's plain API call passes: the class check refuses package requests, not the host."""
    resp = fetch(tpk, scheme, "/v1/items", DENY_SOURCE)
    assert resp.status == 200, resp.raw[:400]
