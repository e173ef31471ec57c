"""The real audit sink: DNS decisions land as OTLP/JSON records, and `audit replay` re-decides them alike."""

from __future__ import annotations

from egressgate.audit.filesink import FileSink
from egressgate.audit.record import parse_line
from egressgate.audit.replay import replay
from egressgate.audit.signer import LocalEd25519Signer
from egressgate.dns.server import DnsServer
from tests.support.dnsclients import POLICIES, SANDBOX_IP, addresses, ask, rcode


async def test_records_in_file_and_replay_agrees(tmp_path, policies, state, upstream, dns_config):
    sink = await FileSink(tmp_path / "audit" / "audit.jsonl", LocalEd25519Signer.generate()).start()
    srv = DnsServer(policies.get, state, sink, dns_config)
    await srv.start("127.0.0.1", 0)
    try:
        assert addresses(await ask(srv, "allowed.example.com")) == ["93.184.216.34"]
        assert rcode(await ask(srv, "evil.example.org")) == "NXDOMAIN"
        assert rcode(await ask(srv, "txt.example.com", "TXT")) == "REFUSED"
        assert addresses(await ask(srv, "allowed.example.com", "AAAA")) == ["2606:2800:220:1:248:1893:25c8:1946"]
    finally:
        await srv.stop()
        await sink.close()

    lines = [ln for ln in (tmp_path / "audit" / "audit.jsonl").read_bytes().splitlines() if ln.strip()]
    records = [parse_line(ln) for ln in lines]
    dns_records = [r for r in records if r.attributes.get("egressgate.operation") == "dns_query"]
    assert len(dns_records) == 4
    first = dns_records[0].attributes
    assert first["egressgate.decision"] == "allow"
    assert first["egressgate.sandbox.id"] == "sbx-test"
    assert first["egressgate.dns.answers"] == ["A 93.184.216.34"]
    assert first["egressgate.dns.rcode"] == "NOERROR"
    assert first["egressgate.state.dns_queries"] == 0  # the state decide() saw
    assert [r.attributes["egressgate.state.dns_queries"] for r in dns_records] == [0, 1, 2, 3]
    assert [r.attributes["egressgate.state.dns_name_bytes"] for r in dns_records] == [0, 19, 35, 50]
    # Only what a DNS decision reads is recorded as state; the facts are the record's own attributes.
    assert not {k for k in first if k.startswith("egressgate.state.")} - {
        "egressgate.state.admitted_at",
        "egressgate.state.dns_queries",
        "egressgate.state.dns_name_bytes",
    }
    assert "egressgate.facts.addresses" not in first
    assert {r.attributes["egressgate.dns.stage"] for r in dns_records} == {"decide"}
    denied = dns_records[1].attributes
    assert (denied["egressgate.decision"], denied["egressgate.reason"]) == ("deny", "host_not_allowed")
    assert denied["egressgate.dns.rcode"] == "NXDOMAIN"
    assert {r.attributes["client.address"] for r in dns_records} == {SANDBOX_IP}
    assert denied["dns.question.name"] == "evil.example.org"

    policy_file = tmp_path / "dns-test.yaml"
    policy_file.write_text(POLICIES["dns-test"])
    result = replay([tmp_path / "audit" / "audit.jsonl"], policy_file)
    assert result.replayed == 4
    assert result.changes == []
    assert result.approximated_state == 0  # every record carried the state decide() was given


async def test_replay_uses_the_recorded_dns_counters(tmp_path, policies, state, upstream, dns_config):
    """A policy adding a DNS query budget, replayed over a log made without one, denies exactly the queries
    beyond the budget: the recorded counters are the ones the resolver had (not rebuilt from the log)."""
    sink = await FileSink(tmp_path / "audit" / "audit.jsonl", LocalEd25519Signer.generate()).start()
    srv = DnsServer(policies.get, state, sink, dns_config)
    await srv.start("127.0.0.1", 0)
    await state.add_dns_query("sbx-test", 10)  # spent by this sandbox before this log began (another file)
    try:
        for _ in range(3):
            assert addresses(await ask(srv, "allowed.example.com")) == ["93.184.216.34"]
    finally:
        await srv.stop()
        await sink.close()
    budgeted = tmp_path / "dns-test.yaml"
    budgeted.write_text(POLICIES["dns-test"].replace("  dns:\n", "  dns:\n    budget: {queries: 3}\n"))
    result = replay([tmp_path / "audit" / "audit.jsonl"], budgeted)
    assert result.replayed == 3 and result.approximated_state == 0
    # counters before each query were 1, 2, 3: only the last is over a budget of 3
    assert [(c.direction, c.new_reason) for c in result.changes] == [("allow->deny", "budget_exceeded")]
