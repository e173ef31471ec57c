"""Fixtures for the DNS resolver tests: the recording upstream (tests/support/dnsupstream.py), the
sandboxes and policies (tests/support/dnsclients.py), a memory state and an in-memory audit sink, and the
resolver under test on 127.0.0.1."""

from __future__ import annotations

import time

import pytest

from egressgate.dns.config import DnsConfig
from egressgate.dns.server import DnsServer
from egressgate.policy.loader import parse_policy
from egressgate.state.base import SandboxRecord, hash_token
from egressgate.state.memory import MemoryState
from tests.support.dnsclients import (
    BUDGET_IP,
    POLICIES,
    PRIVATE_IP,
    RATE_IP,
    REFUSED_IP,
    SANDBOX_IP,
    RecordingSink,
)
from tests.support.dnsupstream import FakeUpstream


@pytest.fixture
def policies():
    return {name: parse_policy(text, f"<{name}>") for name, text in POLICIES.items()}


@pytest.fixture
async def state():
    store = MemoryState()
    for sandbox_id, ip, policy in [
        ("sbx-test", SANDBOX_IP, "dns-test"),
        ("sbx-private", PRIVATE_IP, "dns-private"),
        ("sbx-budget", BUDGET_IP, "dns-budget"),
        ("sbx-refused", REFUSED_IP, "dns-refused"),
        ("sbx-rate", RATE_IP, "dns-rate"),
    ]:
        await store.admit(
            SandboxRecord(
                id=sandbox_id,
                token_hash=hash_token("t-" + sandbox_id),
                policy_name=policy,
                admitted_at=time.time(),
                addresses=(ip,),
            )
        )
    return store


@pytest.fixture
def audit():
    return RecordingSink()


@pytest.fixture
async def upstream():
    server = FakeUpstream()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def dns_config(upstream):
    return DnsConfig(upstreams=(upstream.address,), upstream_timeout=0.4, tcp_idle_timeout=1.0, tcp_max_connections=8)


@pytest.fixture
async def server(policies, state, audit, dns_config):
    srv = DnsServer(policies.get, state, audit, dns_config)
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.stop()
