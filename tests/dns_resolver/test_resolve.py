"""Allowed names resolve, denied names never leave, answers carry nothing private: end to end over loopback."""

from __future__ import annotations

import asyncio
import socket

import dns.flags
import dns.rdatatype
import pytest

from egressgate.dns.server import DnsServer
from egressgate.state.base import SandboxRecord, hash_token
from tests.support.dnsclients import (
    POLICIES,
    PRIVATE_IP,
    REFUSED_IP,
    SANDBOX_IP,
    UNKNOWN_IP,
    addresses,
    ask,
    dig,
    rcode,
)


async def test_allowed_name_resolves_through_upstream(server, upstream, audit):
    response = await ask(server, "allowed.example.com")
    assert rcode(response) == "NOERROR"
    assert addresses(response) == ["93.184.216.34"]
    assert upstream.seen == [("allowed.example.com", "A", "udp")]
    event = audit.events[-1]
    assert (event.sandbox_id, event.decision, event.reason, event.host, event.qtype) == (
        "sbx-test",
        "allow",
        "rule_matched",
        "allowed.example.com",
        "A",
    )
    assert event.answers == ["A 93.184.216.34"]
    assert event.client_address == SANDBOX_IP and event.rule_id == "dns.allow[0]"


async def test_dig_resolves_allowed_and_aaaa(server):
    out = await dig(server, "allowed.example.com", "AAAA")
    assert "status: NOERROR" in out
    assert "2606:2800:220:1:248:1893:25c8:1946" in out


async def test_wildcard_and_rule_hosts_are_resolvable(server, upstream):
    assert addresses(await ask(server, "x.wild.example.com")) == ["93.184.216.36"]
    # api.example.net is not in dns.allow, but an https rule names it: the sandbox must be able to resolve it
    assert addresses(await ask(server, "api.example.net")) == ["93.184.216.35"]
    assert upstream.names() == ["x.wild.example.com", "api.example.net"]


async def test_query_name_case_is_echoed_and_canonical_name_forwarded(server, upstream):
    response = await ask(server, "AlLoWeD.ExAmPlE.CoM")
    assert rcode(response) == "NOERROR"
    assert response.question[0].name.to_text() == "AlLoWeD.ExAmPlE.CoM."
    assert addresses(response) == ["93.184.216.34"]
    assert upstream.seen == [("allowed.example.com", "A", "udp")]


async def test_denied_names_never_reach_upstream(server, upstream, audit):
    denied = [
        "evil.example.org",
        "wild.example.com",  # the wildcard covers subdomains only
        "c2VjcmV0LXRva2VuLXZhbHVl.attacker.example",  # exfil-shaped: base64 label
        "4a6f686e.536d697468.exfil.example.net",
        "allowed.example.com.attacker.example",  # allowed name as a prefix
        "xallowed.example.com",  # suffix lookalike
        "metadata.google.internal",
    ]
    for name in denied:
        response = await ask(server, name)
        assert rcode(response) == "NXDOMAIN", name
        assert not response.answer
    out = await dig(server, "evil.example.org", "A")
    assert "status: NXDOMAIN" in out
    assert upstream.seen == []
    reasons = {e.host: e.reason for e in audit.events}
    assert reasons["evil.example.org"] == "host_not_allowed"
    assert reasons["metadata.google.internal"] == "metadata_endpoint"
    assert all(e.decision == "deny" and e.sandbox_id == "sbx-test" for e in audit.events)
    # positive control: the same upstream does answer when a name is allowed
    assert addresses(await ask(server, "allowed.example.com")) == ["93.184.216.34"]
    assert upstream.names() == ["allowed.example.com"]


async def test_policy_deny_rcode_refused(server, upstream):
    response = await ask(server, "evil.example.org", source=REFUSED_IP)
    assert rcode(response) == "REFUSED"
    assert upstream.seen == []


async def test_unknown_client_is_denied_and_audited(server, upstream, audit):
    response = await ask(server, "allowed.example.com", source=UNKNOWN_IP)
    assert rcode(response) == "REFUSED"
    assert upstream.seen == []
    assert audit.events[-1].reason == "identity_unknown" and audit.events[-1].sandbox_id is None
    assert audit.events[-1].client_address == UNKNOWN_IP


async def test_unknown_client_policy_applies_when_configured(policies, state, audit, upstream, dns_config):
    from dataclasses import replace

    srv = DnsServer(policies.get, state, audit, replace(dns_config, unknown_client_policy="dns-refused"))
    await srv.start("127.0.0.1", 0)
    try:
        assert addresses(await ask(srv, "allowed.example.com", source=UNKNOWN_IP)) == ["93.184.216.34"]
        assert rcode(await ask(srv, "x.wild.example.com", source=UNKNOWN_IP)) == "REFUSED"
        assert upstream.names() == ["allowed.example.com"]
    finally:
        await srv.stop()


async def test_revoked_sandbox_is_refused(server, state, upstream, audit):
    await state.revoke("sbx-test")
    assert rcode(await ask(server, "allowed.example.com")) == "REFUSED"
    assert upstream.seen == []
    assert audit.events[-1].reason in ("identity_unknown", "sandbox_revoked")


async def test_query_types_txt_any_axfr_refused(server, upstream, audit):
    for qtype in ("TXT", "ANY", "SRV", "NULL", "MX"):
        response = await ask(server, "txt.example.com", qtype)
        assert rcode(response) == "REFUSED", qtype
    assert audit.events[-1].reason == "qtype_not_allowed"
    out = await dig(server, "allowed.example.com", "AXFR")
    assert "Transfer failed" in out or "REFUSED" in out
    out = await dig(server, "allowed.example.com", "IXFR=1")
    assert "REFUSED" in out or "failed" in out
    assert upstream.seen == []


async def test_policy_can_allow_txt_but_never_axfr(server, upstream):
    response = await ask(server, "txt.example.com", "TXT", source=REFUSED_IP)
    assert rcode(response) == "NOERROR"
    assert b"v=exfil-capable" in response.answer[0][0].strings[0]
    out = await dig(server, "txt.example.com", "AXFR", source=REFUSED_IP)
    assert "Transfer failed" in out or "REFUSED" in out
    assert upstream.seen == [("txt.example.com", "TXT", "udp")]


async def test_private_loopback_metadata_answers_stripped(server, upstream, audit):
    for name, qtype in [
        ("private.example.com", "A"),
        ("loop.example.com", "A"),
        ("loop.example.com", "AAAA"),
        ("meta.example.com", "A"),
        ("mapped.example.com", "AAAA"),
        ("nat64.example.com", "AAAA"),
        ("cgnat.example.com", "A"),
    ]:
        response = await ask(server, name, qtype)
        assert rcode(response) == "NXDOMAIN", (name, qtype)
        assert addresses(response) == [], (name, qtype)
        assert audit.events[-1].reason == "address_forbidden"
        assert audit.events[-1].answers == []
        assert audit.events[-1].extra["egressgate.dns.stage"] == "answer_filter"
    # positive control: the upstream really sent those addresses (the resolver asked and got them)
    assert ("mapped.example.com", "AAAA", "udp") in upstream.seen
    assert server.metrics.emptied_answers == 7


async def test_an_emptied_answer_replays_as_the_same_deny(server, audit, policies):
    """Issue 23, item 1: the answer filter's deny carries the addresses it removed, so `audit replay` with
    the same policy re-decides it as the same deny (it used to flip to an allow: the engine alone allows the
    name). Positive control: a policy whose allow_private covers the address flips exactly that record."""
    from egressgate.audit.record import record_from_event
    from egressgate.audit.replay import replay_diff
    from egressgate.policy.loader import parse_policy

    response = await ask(server, "private.example.com", "A")
    assert rcode(response) == "NXDOMAIN"
    event = audit.events[-1]
    assert event.reason == "address_forbidden" and event.extra["egressgate.facts.addresses"]
    allowed = await ask(server, "mixed.example.com")  # an allowed answer: replays as an allow
    assert rcode(allowed) == "NOERROR"
    records = [record_from_event(e) for e in audit.events]
    assert replay_diff(records, policies["dns-test"]) == []
    opened = parse_policy(POLICIES["dns-test"].replace("network:\n", "network:\n  allow_private: [10.0.0.0/8]\n"),
                          "<dns-test-open>")
    [flip] = replay_diff(records, opened)
    assert flip.direction == "deny->allow" and flip.target == "private.example.com A"


async def test_mixed_answer_keeps_only_global(server):
    response = await ask(server, "mixed.example.com")
    assert rcode(response) == "NOERROR"
    assert addresses(response) == ["93.184.216.41"]


async def test_cname_chain_to_private_address_stripped(server, upstream):
    response = await ask(server, "cname-private.example.com")
    assert rcode(response) == "NXDOMAIN"
    assert not response.answer
    ok = await ask(server, "cname-ok.example.com")
    assert rcode(ok) == "NOERROR"
    assert addresses(ok) == ["93.184.216.40"]
    assert [rrset.rdtype for rrset in ok.answer] == [dns.rdatatype.CNAME, dns.rdatatype.A]


async def test_records_off_the_chain_are_removed(server):
    response = await ask(server, "inject.example.com")
    names = {rrset.name.to_text() for rrset in response.answer}
    assert names == {"inject.example.com."}
    assert addresses(response) == ["93.184.216.42"]


async def test_allow_private_covers_rfc1918_but_never_metadata(server):
    response = await ask(server, "private.example.com", source=PRIVATE_IP)
    assert addresses(response) == ["10.1.2.3"]
    assert rcode(await ask(server, "meta.example.com", source=PRIVATE_IP)) == "NXDOMAIN"
    assert rcode(await ask(server, "loop.example.com", source=PRIVATE_IP)) == "NXDOMAIN"
    # the cache entry is shared; the filtered view is per policy
    assert rcode(await ask(server, "private.example.com")) == "NXDOMAIN"


async def test_https_record_hints_stripped(server):
    response = await ask(server, "svc.example.com", "HTTPS")
    assert rcode(response) == "NOERROR"
    records = [rd for rrset in response.answer for rd in rrset]
    assert len(records) == 1  # the record with mandatory=ipv4hint cannot be made safe: removed
    text = records[0].to_text()
    assert "alpn" in text and "ipv4hint" not in text and "ipv6hint" not in text


async def test_upstream_nxdomain_passes_with_soa(server, upstream):
    response = await ask(server, "nx.example.com")
    assert rcode(response) == "NXDOMAIN"
    assert response.authority and response.authority[0].rdtype == dns.rdatatype.SOA


async def test_cache_hit_one_upstream_query(server, upstream, audit):
    first = await ask(server, "cached.example.com")
    second = await ask(server, "cached.example.com")
    assert addresses(first) == addresses(second) == ["93.184.216.43"]
    assert upstream.seen == [("cached.example.com", "A", "udp")]
    assert [e.extra["egressgate.dns.cache"] for e in audit.events] == ["miss", "hit"]
    assert second.answer[0].ttl <= 300


async def test_concurrent_identical_queries_coalesce(server, upstream):
    results = await asyncio.gather(*(ask(server, "x.wild.example.com") for _ in range(10)))
    assert all(addresses(r) == ["93.184.216.36"] for r in results)
    assert upstream.seen == [("x.wild.example.com", "A", "udp")]


async def test_negative_answers_are_cached(server, upstream):
    await ask(server, "nx.example.com")
    await ask(server, "nx.example.com")
    assert upstream.names() == ["nx.example.com"]


async def test_upstream_timeout_servfail_not_cached(server, upstream, audit):
    upstream.behaviour["slow.example.com"] = "timeout"
    response = await ask(server, "slow.example.com")
    assert rcode(response) == "SERVFAIL"
    assert audit.events[-1].extra["egressgate.dns.rcode"] == "SERVFAIL"
    del upstream.behaviour["slow.example.com"]
    upstream.zone["slow.example.com"] = ["slow.example.com. 60 A 93.184.216.60"]
    assert addresses(await ask(server, "slow.example.com")) == ["93.184.216.60"]
    assert server.metrics.upstream_timeouts == 1


async def test_upstream_servfail_and_second_upstream(policies, state, audit, upstream, dns_config):
    """The first upstream answers SERVFAIL for the name; a dead second one times out; then SERVFAIL."""
    from dataclasses import replace

    upstream.behaviour["servfail.example.com"] = "servfail"
    dead = ("127.0.0.1", upstream.address[1])  # same server again: it keeps failing
    srv = DnsServer(policies.get, state, audit, replace(dns_config, upstreams=(upstream.address, dead)))
    await srv.start("127.0.0.1", 0)
    try:
        assert rcode(await ask(srv, "servfail.example.com")) == "SERVFAIL"
        assert upstream.names() == ["servfail.example.com", "servfail.example.com"]
        assert rcode(await ask(srv, "allowed.example.com")) == "NOERROR"
    finally:
        await srv.stop()


@pytest.mark.parametrize("mode", ["spoof", "spoof-source", "spoof-question"])
async def test_forged_upstream_replies_ignored(server, upstream, mode):
    upstream.behaviour["spoof.example.com"] = mode
    upstream.zone["spoof.example.com"] = ["spoof.example.com. 60 A 93.184.216.61"]
    response = await ask(server, "spoof.example.com")
    assert addresses(response) == ["93.184.216.61"]  # the real answer, not POISON
    if mode != "spoof-source":  # the connected socket makes the kernel drop the other source's datagram
        assert server.metrics.upstream_mismatches >= 1


async def test_failover_to_next_upstream(policies, state, audit, upstream, dns_config):
    from dataclasses import replace

    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a port nobody listens on: ICMP unreachable
    closed.bind(("127.0.0.1", 0))
    dead = closed.getsockname()
    closed.close()
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # listens, never answers: a timeout
    silent.bind(("127.0.0.1", 0))
    try:
        upstreams = (dead, silent.getsockname(), upstream.address)
        srv = DnsServer(policies.get, state, audit, replace(dns_config, upstreams=upstreams, upstream_timeout=0.2))
        await srv.start("127.0.0.1", 0)
        try:
            assert addresses(await ask(srv, "allowed.example.com")) == ["93.184.216.34"]
            assert srv.metrics.upstream_timeouts == 1 and srv.metrics.upstream_errors == 1
        finally:
            await srv.stop()
    finally:
        silent.close()


async def test_ttl_caps_and_expiry(policies, state, audit, upstream, dns_config):
    from dataclasses import replace

    upstream.zone["cached.example.com"] = ["cached.example.com. 1 A 93.184.216.43"]
    upstream.zone["allowed.example.com"] = ["allowed.example.com. 86400 A 93.184.216.34"]
    srv = DnsServer(policies.get, state, audit, replace(dns_config, cache_min_ttl=1, cache_max_ttl=60))
    await srv.start("127.0.0.1", 0)
    try:
        long_lived = await ask(srv, "allowed.example.com")
        assert long_lived.answer[0].ttl <= 60  # max cap applies to what clients are told
        await ask(srv, "cached.example.com")
        await ask(srv, "cached.example.com")
        assert upstream.names().count("cached.example.com") == 1
        await asyncio.sleep(1.2)
        await ask(srv, "cached.example.com")
        assert upstream.names().count("cached.example.com") == 2  # expired after its 1 s TTL
    finally:
        await srv.stop()


async def test_malformed_upstream_record_is_servfail(server, upstream):
    upstream.behaviour["badlen.example.com"] = "badlen"
    upstream.zone["badlen.example.com"] = ["badlen.example.com. 300 A 93.184.216.62"]
    assert rcode(await ask(server, "badlen.example.com")) == "SERVFAIL"


async def test_udp_truncation_and_tcp_fallback(server, upstream):
    plain = await ask(server, "big.example.com", edns=None)  # 512-byte limit, 60 A records do not fit
    assert plain.flags & dns.flags.TC and not plain.answer
    full = await ask(server, "big.example.com", tcp=True)
    assert len(addresses(full)) == 60
    edns = await ask(server, "big.example.com", edns=4096)  # fits in our 1232
    assert not edns.flags & dns.flags.TC and len(addresses(edns)) == 60
    out = await dig(server, "+noedns", "big.example.com")  # dig retries over TCP by itself
    assert "Truncated, retrying in TCP mode" in out and out.count("\tA\t") == 60
    assert server.metrics.truncated >= 2


async def test_upstream_truncation_retried_over_tcp(server, upstream):
    response = await ask(server, "huge.example.com", tcp=True)
    assert len(addresses(response)) == 150
    assert upstream.seen == [("huge.example.com", "A", "udp"), ("huge.example.com", "A", "tcp")]
    over_udp = await ask(server, "huge.example.com", edns=4096)  # larger than our 1232 cap
    assert over_udp.flags & dns.flags.TC


async def test_audit_failure_fails_closed(server, upstream, audit):
    audit.fail_writes = True
    assert rcode(await ask(server, "allowed.example.com")) == "SERVFAIL"
    assert rcode(await ask(server, "evil.example.org")) == "SERVFAIL"
    audit.fail_writes, audit.unhealthy = False, True
    assert rcode(await ask(server, "cached.example.com")) == "SERVFAIL"
    assert "cached.example.com" not in upstream.names()  # nothing leaves while the audit trail is down
    audit.unhealthy = False
    assert rcode(await ask(server, "allowed.example.com")) == "NOERROR"
    assert server.metrics.audit_failures == 3


async def test_dig_over_tcp_and_ipv6_listener(policies, state, audit, upstream, dns_config, server):
    out = await dig(server, "+tcp", "cname-ok.example.com")
    assert "status: NOERROR" in out and "93.184.216.40" in out
    await state.admit(
        SandboxRecord(
            id="sbx-v6", token_hash=hash_token("t"), policy_name="dns-test", admitted_at=0.0, addresses=("::1",)
        )
    )
    srv = DnsServer(policies.get, state, audit, dns_config)
    host, port = await srv.start("::1", 0)
    try:
        assert host == "::1"
        proc = await asyncio.create_subprocess_exec(
            "dig",
            "@::1",
            "-p",
            str(port),
            "-b",
            "::1",
            "+time=2",
            "+tries=1",
            "allowed.example.com",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        assert "93.184.216.34" in out.decode()
        assert audit.events[-1].sandbox_id == "sbx-v6"
    finally:
        await srv.stop()


async def test_upstream_pointing_at_itself_is_refused(policies, state, audit, upstream, dns_config):
    from dataclasses import replace

    from egressgate.dns.config import DnsConfigError

    probe = DnsServer(policies.get, state, audit, dns_config)
    _, port = await probe.start("127.0.0.1", 0)
    await probe.stop()
    srv = DnsServer(policies.get, state, audit, replace(dns_config, upstreams=(("127.0.0.1", port),)))
    with pytest.raises(DnsConfigError):
        await srv.start("127.0.0.1", port)
    assert srv.address is None


def test_config_validation_and_resolv_conf():
    from egressgate.dns.config import DnsConfig, DnsConfigError, parse_resolv_conf

    text = "# comment\nnameserver 192.0.2.53\nnameserver ::1 # trailing\nnameserver not-an-ip\nsearch example.com\n"
    assert parse_resolv_conf(text) == (("192.0.2.53", 53), ("::1", 53))
    for bad in (
        {"deny_rcode": "SERVFAIL"},
        {"upstream_timeout": 0},
        {"cache_min_ttl": 10, "cache_max_ttl": 5},
        {"upstreams": (("dns.example.com", 53),)},
        {"max_udp_response": 100},
    ):
        with pytest.raises(DnsConfigError):
            DnsConfig(**bad).validate()


async def test_seed_policy_from_the_article(state, audit, upstream, dns_config):
    """The article's policy file, unchanged: its three names resolve, nothing else does."""
    from pathlib import Path

    from egressgate.policy.loader import load_policy

    seed = load_policy(Path(__file__).resolve().parents[2] / "policies" / "seed-invoice-analysis.yaml")
    await state.admit(
        SandboxRecord(
            id="sbx-seed", token_hash=hash_token("t"), policy_name=seed.name, admitted_at=0.0, addresses=("127.0.0.7",)
        )
    )
    upstream.zone["pypi.org"] = ["pypi.org. 300 A 151.101.0.223"]
    upstream.zone["api.openai.com"] = [
        "api.openai.com. 300 CNAME edge.openai.example.",
        "edge.openai.example. 60 A 104.18.6.192",
    ]
    srv = DnsServer({seed.name: seed}.get, state, audit, dns_config)
    await srv.start("127.0.0.1", 0)
    try:
        assert addresses(await ask(srv, "pypi.org", source="127.0.0.7")) == ["151.101.0.223"]
        assert addresses(await ask(srv, "api.openai.com", source="127.0.0.7")) == ["104.18.6.192"]
        for name in ("github.com", "upload.pypi.org", "metadata.google.internal", "api.openai.com.evil.example"):
            assert rcode(await ask(srv, name, source="127.0.0.7")) == "NXDOMAIN", name
        assert rcode(await ask(srv, "pypi.org", "TXT", source="127.0.0.7")) == "REFUSED"
        assert upstream.names() == ["pypi.org", "api.openai.com"]
    finally:
        await srv.stop()
