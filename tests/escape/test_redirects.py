"""Redirects: an allowed upstream answers 302 to the metadata endpoint.

The gateway passes the 302 through and never follows it; a client that follows it makes a new request
that is decided afresh and denied. Positive control: following the same redirect *directly* from the
gateway namespace lands on the metadata canary, so the Location is live.
"""

from __future__ import annotations

import pytest

import tests.networld as nw
from tests.escape.checks import ADDRESS_REASONS, assert_denied, assert_untouched
from tests.networld import World
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

TARGETS = ["http://169.254.169.254/latest/meta-data/", "http://2852039166/latest/meta-data/",
           "http://metadata.google.internal/computeMetadata/v1/", "http://metadata.evil.test/",
           "http://[::ffff:169.254.169.254]/", "http://10.0.0.5/", "https://10.0.0.5/"]


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_gateway_passes_302_but_does_not_follow(
    world: World, gateway: Gateway, sbx: Sandbox, scheme: str
) -> None:
    mark = world.mark()
    res = gateway.curl(sbx, f"{scheme}://api.allowed.test/redirect-metadata")
    assert res.status == 302, res
    assert "location: http://169.254.169.254/latest/meta-data/" in res.headers.lower()
    assert_untouched(world, mark, "redirect passed through")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("scheme", ["https", "http"])
def test_following_the_redirect_is_decided_afresh_and_denied(
    world: World, gateway: Gateway, sbx: Sandbox, scheme: str, target: str
) -> None:
    mark = world.mark()
    res = gateway.curl(sbx, f"{scheme}://api.allowed.test/redirect?to={target}", "-L")
    # curl 7.88 drops the brackets of an IPv6 literal in the Host header of a followed redirect; the
    # gateway rightly refuses that malformed Host before classifying the address
    extra = {"host_mismatch", "invalid_request"} if "[" in target else set()
    assert_denied(res, ADDRESS_REASONS | extra)
    assert_untouched(world, mark, target)


@pytest.mark.parametrize("target", TARGETS)
def test_positive_control_direct_follow_hits_canary(world: World, target: str) -> None:
    mark = world.mark()
    res = world.curl(world.gw, "-L", "--resolve", f"api.allowed.test:80:{nw.UPSTREAM}",
                     "--resolve", f"metadata.google.internal:80:{'169.254.169.254'}",
                     "--resolve", "metadata.evil.test:80:169.254.169.254",
                     f"http://api.allowed.test/redirect?to={target}")
    assert res.returncode == 0, res.stderr
    assert "CANARY:" in res.stdout
    assert world.canary_hits(mark)
