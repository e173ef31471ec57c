"""Requests looping back into the gateway's own listeners (proxy, admin API) are refused.

escape-self allows the gateway's address and 127.0.0.1 by rule *and* in allow_private, on exactly the
listener ports, so only the self-connection check stands in the way. Positive control: under the same
policy the gateway does dial another port on its own address and on its loopback (canaries answer).
"""

from __future__ import annotations

import pytest

import tests.networld as nw
from tests.escape.checks import assert_denied, assert_untouched, proxied_get
from tests.networld import World
from tests.support.http1 import parse_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def sbx_self(gateway: Gateway) -> Sandbox:
    return gateway.admit("escape-self")


def _listeners(gateway: Gateway) -> dict[str, str]:
    admin_port = gateway.info["admin"].rpartition(":")[2]
    return {"proxy": f"{gateway.proxy[0]}:{gateway.proxy[1]}", "admin": f"127.0.0.1:{admin_port}"}


@pytest.mark.parametrize("which", ["proxy", "admin"])
def test_connect_to_own_listener_is_denied(world: World, gateway: Gateway, sbx_self: Sandbox, which: str) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx_self, _listeners(gateway)[which])
    with sock:
        assert_denied(resp, {"self_connection"})
    assert_untouched(world, mark, which)


@pytest.mark.parametrize("which", ["proxy", "admin"])
def test_absolute_form_to_own_listener_is_denied(
    world: World, gateway: Gateway, sbx_self: Sandbox, which: str
) -> None:
    path = "/v1/sandboxes" if which == "admin" else "/"
    raw = gateway.raw(proxied_get(sbx_self, f"http://{_listeners(gateway)[which]}{path}"))
    assert_denied(parse_response(raw), {"self_connection"})


@pytest.mark.parametrize(("url", "canary"), [
    (f"http://{nw.GW_SBX}:{nw.GW_SELF_CANARY_PORT}/control", "gateway-self"),
    ("http://127.0.0.1:80/control", "loopback"),
])
def test_positive_control_own_host_other_port_is_reachable_when_allowed(
    world: World, gateway: Gateway, sbx_self: Sandbox, url: str, canary: str
) -> None:
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx_self, url)))
    assert resp.status == 200, resp
    assert f"CANARY:{canary}".encode() in resp.body
    assert world.canary_hits(mark)
