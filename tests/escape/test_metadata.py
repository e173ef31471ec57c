"""Metadata endpoints are never reachable, by name or address, whatever the policy says.

escape-https allows ``metadata.google.internal`` and ``169.254.169.254`` by rule; escape-metadata-covered
additionally puts every metadata range inside ``allow_private``. The test resolver answers
metadata.google.internal with the canary's address, so a gateway that resolved and dialled it would
land on the canary. Positive control: curl from the gateway namespace with the same name reaches it.
"""

from __future__ import annotations

import pytest

from tests.escape.checks import assert_denied, assert_untouched, proxied_get
from tests.networld import World
from tests.support.http1 import parse_response
from tests.support.netgateway import Gateway

pytestmark = pytest.mark.netns

POLICIES = ["escape-https", "escape-metadata-covered"]
URLS = [
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://METADATA.google.internal./computeMetadata/v1/",
    "https://metadata.google.internal/computeMetadata/v1/",
    "http://169.254.169.254/latest/meta-data/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://100.100.100.200/latest/meta-data/",
    "http://168.63.129.16/machine?comp=goalstate",
]


def test_positive_control_metadata_name_resolves_to_canary(world: World) -> None:
    mark = world.mark()
    res = world.curl(world.gw, "http://metadata.google.internal/computeMetadata/v1/")
    assert "CANARY:metadata" in res.stdout, res.stderr
    assert world.canary_hits(mark)


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("policy", POLICIES)
def test_metadata_is_denied_even_when_policy_allows(world: World, gateway: Gateway, policy: str, url: str) -> None:
    sbx = gateway.admit(policy)
    mark = world.mark()
    res = gateway.curl(sbx, url)
    reason = assert_denied(res, {"metadata_endpoint", "address_forbidden", "host_not_allowed"})
    if policy == "escape-metadata-covered":
        assert reason == "metadata_endpoint", res
    assert_untouched(world, mark, url)


FULLWIDTH_METADATA = "".join(chr(ord(c) + 0xFEE0) for c in "metadata") + ".google.internal"


ENCODED_METADATA = ["ⓜetadata.google.internal", FULLWIDTH_METADATA, "metadata.google.internal%2e",
                    "metadata%2egoogle%2einternal", "xn--metadata-.google.internal", "metadata.google.internal:80"]


@pytest.mark.parametrize("name", ENCODED_METADATA)
def test_unicode_and_encoded_metadata_names_are_refused(world: World, gateway: Gateway, name: str) -> None:
    """Names that normalise (UTS 46, percent-decoding) to the metadata host must not slip past a check
    done on the raw spelling."""
    sbx = gateway.admit("escape-https")
    mark = world.mark()
    raw = gateway.raw(proxied_get(sbx, f"http://{name}/computeMetadata/v1/", host=name))
    if raw:
        assert parse_response(raw).status >= 400, raw[:300]
    sock, resp = gateway.tunnel(sbx, f"{name}:443" if ":" not in name else name)
    with sock:
        assert resp.status >= 400, resp
    assert_untouched(world, mark, name)
