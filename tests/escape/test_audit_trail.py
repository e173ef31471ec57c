"""Every refused escape attempt leaves an audit record naming the sandbox, the decision and the reason.

An escape that is blocked but not recorded is invisible to the operator; one that is recorded with a
different reason than the sandbox was told is a lie in the trail. The request id in the deny response
is the join key.
"""

from __future__ import annotations

import pytest

from tests.escape.checks import deny_reason, proxied_get
from tests.networld import World
from tests.support.http1 import parse_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

ATTEMPTS = {
    "metadata-literal": "http://169.254.169.254/latest/meta-data/",
    "metadata-decimal": "http://2852039166/latest/meta-data/",
    "metadata-name": "http://metadata.google.internal/computeMetadata/v1/",
    "private-name": "http://private.evil.test/",
    "loopback-mapped": "http://[::ffff:127.0.0.1]/",
}


@pytest.mark.parametrize("attempt", sorted(ATTEMPTS))
def test_refused_attempt_is_audited_with_the_same_reason(
    world: World, gateway: Gateway, sbx: Sandbox, attempt: str
) -> None:
    resp = parse_response(gateway.raw(proxied_get(sbx, ATTEMPTS[attempt])))
    reason = deny_reason(resp)
    record = gateway.audit_record(resp.headers["x-egressgate-request-id"])
    assert record["egressgate.decision"] == "deny"
    assert record["egressgate.reason"] == reason
    assert record["egressgate.sandbox.id"] == sbx.id
    assert record["egressgate.policy.name"] == "escape-https"


def test_refused_connect_is_audited(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    sock, resp = gateway.tunnel(sbx, "0xa9fea9fe:443")
    with sock:
        reason = deny_reason(resp)
    record = gateway.audit_record(resp.headers["x-egressgate-request-id"])
    assert (record["egressgate.decision"], record["egressgate.reason"]) == ("deny", reason)
    assert record["egressgate.sandbox.id"] == sbx.id
