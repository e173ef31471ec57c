"""A DNS query refused for identity (unknown or revoked client) is recorded with the name it asked for.

The raw labels were always in `egressgate.target.as_sent`; the canonical name (what a rule would match
and an auditor searches by) was missing, because the identity check runs before the name checks. A name
that is not already canonical is never guessed: the record then has the raw text only.
"""

from __future__ import annotations

from egressgate.audit.record import K_HOST, event_attributes
from tests.support.dnsclients import SANDBOX_IP, UNKNOWN_IP, ask, rcode


async def test_unknown_client_record_names_the_canonical_name(server, upstream, audit):
    assert rcode(await ask(server, "Allowed.Example.COM", source=UNKNOWN_IP)) == "REFUSED"
    event = audit.events[-1]
    assert event.reason == "identity_unknown" and event.sandbox_id is None
    assert event.target_as_sent == "Allowed.Example.COM"
    assert event.host == "allowed.example.com"
    attrs = event_attributes(event)
    assert attrs[K_HOST] == "allowed.example.com" and attrs["egressgate.target.canonical"] == "allowed.example.com A"
    assert upstream.seen == []


async def test_unknown_client_uncanonical_name_is_recorded_raw_only(server, upstream, audit):
    assert rcode(await ask(server, "0x7f.1", source=UNKNOWN_IP)) == "REFUSED"
    event = audit.events[-1]
    assert event.reason == "identity_unknown"
    assert event.target_as_sent == "0x7f.1" and event.host is None  # canon.py reads it as 127.0.0.1: not guessed


async def test_revoked_client_record_names_the_name(server, state, upstream, audit):
    await state.revoke("sbx-test")
    assert rcode(await ask(server, "allowed.example.com", source=SANDBOX_IP)) == "REFUSED"
    event = audit.events[-1]
    # the store forgets a revoked sandbox's addresses, so this is identity_unknown (or sandbox_revoked)
    assert event.reason in ("identity_unknown", "sandbox_revoked") and event.host == "allowed.example.com"
    assert upstream.seen == []
