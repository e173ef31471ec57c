"""A sandbox token is bound to the source addresses its sandbox was admitted with (issue 20): presented
from any other address it is refused (407 `identity_address_mismatch`, audited under the token's sandbox
with the address it came from) and nothing reaches the upstream. Sandboxes are told apart by their
127/8 source address (loopback world). A sandbox admitted without addresses is not bound; one admitted
with several addresses works from each of them. That the transparent listener never takes a token (the
source address alone is the identity) is tested with real runs: tests/runtimes/test_secrets_off_argv.py.
"""

from __future__ import annotations

from tests.support.gwworld import Gateway
from tests.support.sources import admit, connect_from, fresh_address, https_get, mismatch_records, plain_from
from tests.support.waiting import wait_for


def test_token_from_another_sandboxes_address_is_refused(gateway: Gateway) -> None:
    a_addr, b_addr = fresh_address(), fresh_address()
    a, b = admit(gateway, [a_addr]), admit(gateway, [b_addr])
    target = f"api.test:{gateway.world.https_port}"
    mark = gateway.world.hits.mark()
    try:
        # A's token from B's address: refused on the CONNECT and on an absolute-form request
        status, body, sock = connect_from(gateway, b_addr, a, target)
        sock.close()
        assert status == 407 and b'"reason":"identity_address_mismatch"' in body, body
        assert b.id.encode() not in body and a_addr.encode() not in body  # the agent learns no addresses
        status, body = plain_from(gateway, b_addr, a, "/echo/stolen-plain")
        assert status == 407 and b"identity_address_mismatch" in body, body
        # from an address no sandbox holds: the same
        status, body, sock = connect_from(gateway, fresh_address(), a, target)
        sock.close()
        assert status == 407 and b"identity_address_mismatch" in body, body
        assert gateway.world.hits.since(mark) == []  # nothing reached the upstream
        # positive control: the same token from A's own address, and B's own token from B's address
        status, body, sock = connect_from(gateway, a_addr, a, target)
        assert status == 200, body
        assert https_get(gateway, sock, "/v1/own-a") == 200
        assert plain_from(gateway, b_addr, b, "/echo/own-b")[0] == 200
        assert sorted(h["path"] for h in gateway.world.hits.since(mark)) == ["/echo/own-b", "/v1/own-a"]
        # audited under the token's sandbox, with the address it came from and what it was admitted for
        assert wait_for(lambda: len(mismatch_records(gateway, a.id)) == 3, timeout=10), mismatch_records(gateway, a.id)
        records = mismatch_records(gateway, a.id)
        assert {r.get("client.address") for r in records} >= {b_addr}, records
        assert all(f"admitted for {a_addr}" in r["egressgate.detail"] for r in records), records
        assert all(r["egressgate.decision"] == "deny" for r in records)
    finally:
        gateway.revoke(a.id)
        gateway.revoke(b.id)


def test_unbound_sandbox_works_from_anywhere(gateway: Gateway) -> None:
    """`sandbox admit` without --address (an existing container whose address is not known): not bound."""
    sbx = admit(gateway, [])
    try:
        for source in ("127.0.0.1", fresh_address()):
            assert plain_from(gateway, source, sbx, "/echo/unbound")[0] == 200
    finally:
        gateway.revoke(sbx.id)


def test_several_addresses_each_work_others_do_not(gateway: Gateway) -> None:
    """A sandbox that really sends from several addresses is admitted with all of them."""
    first, second = fresh_address(), fresh_address()
    sbx = admit(gateway, [first, second])
    try:
        assert plain_from(gateway, first, sbx, "/echo/multi-1")[0] == 200
        assert plain_from(gateway, second, sbx, "/echo/multi-2")[0] == 200
        status, body = plain_from(gateway, "127.0.0.1", sbx, "/echo/multi-other")
        assert status == 407 and b"identity_address_mismatch" in body
    finally:
        gateway.revoke(sbx.id)


def test_the_binding_rule_is_pure_and_canonical() -> None:
    """The check itself (identity.address_mismatch, source_text): sources compare in the canonical text
    admission stores, so an IPv4 client on a dual-stack listener (::ffff:a.b.c.d) or an IPv6 address in
    another spelling is the address it was admitted with."""
    from mitmproxy import connection

    from egressgate.gateway.pipeline.identity import address_mismatch
    from egressgate.gateway.shared.sources import source_text
    from egressgate.state.base import SandboxRecord

    def client(host: str) -> connection.Client:
        return connection.Client(peername=(host, 40000), sockname=("127.0.0.1", 8080), timestamp_start=0.0)

    bound = SandboxRecord(id="sbx-1", token_hash="x", policy_name="p", admitted_at=0.0,
                          addresses=("198.18.0.2", "2001:db8::2"))
    for ok in ("198.18.0.2", "::ffff:198.18.0.2", "2001:db8:0:0::2", "2001:DB8::2"):
        assert address_mismatch(bound, source_text(client(ok))) is None, ok
    for other in ("198.18.0.6", "::ffff:198.18.0.6", "2001:db8::3", "127.0.0.1"):
        refusal = address_mismatch(bound, source_text(client(other)))
        assert refusal is not None and refusal.reason.value == "identity_address_mismatch", other
        assert "admitted for 198.18.0.2, 2001:db8::2" in (refusal.detail or "")
        assert "198.18.0.2" not in (refusal.message or "")  # the agent is not told the admitted addresses
    unbound = SandboxRecord(id="sbx-2", token_hash="x", policy_name="p", admitted_at=0.0)
    assert address_mismatch(unbound, "203.0.113.9") is None and address_mismatch(unbound, None) is None
    assert address_mismatch(bound, None) is not None  # no peer address: refused, never assumed
