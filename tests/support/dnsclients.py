"""The DNS resolver tests' sandboxes, policies and clients (everything on 127.0.0.0/8).

Sandboxes are told apart by source address (clients bind 127.0.0.x), exactly as a runtime adapter
registers them. `ask` queries with dnspython, `raw_udp` sends arbitrary bytes, `dig` runs the real dig;
`RecordingSink` is an in-memory audit sink that can fail like a broken disk.
"""

from __future__ import annotations

import asyncio

import dns.asyncquery
import dns.message
import dns.rcode
import dns.rdatatype

from egressgate.audit.event import AuditEvent, AuditUnavailable
from egressgate.dns.server import DnsServer

SANDBOX_IP = "127.0.0.2"  # policy dns-test
PRIVATE_IP = "127.0.0.3"  # policy dns-private (allow_private: 10.0.0.0/8)
BUDGET_IP = "127.0.0.4"  # policy dns-budget
REFUSED_IP = "127.0.0.5"  # policy dns-refused (deny_rcode REFUSED, TXT allowed)
RATE_IP = "127.0.0.6"  # policy dns-rate
UNKNOWN_IP = "127.0.0.9"  # registered nowhere

ALLOWED_NAMES = [
    "allowed.example.com",
    "*.wild.example.com",
    "private.example.com",
    "loop.example.com",
    "meta.example.com",
    "mapped.example.com",
    "nat64.example.com",
    "cname-private.example.com",
    "cname-ok.example.com",
    "mixed.example.com",
    "big.example.com",
    "huge.example.com",
    "slow.example.com",
    "cached.example.com",
    "svc.example.com",
    "txt.example.com",
    "nx.example.com",
    "inject.example.com",
    "cgnat.example.com",
    "spoof.example.com",
    "servfail.example.com",
    "badlen.example.com",
    "bench.example.com",
]

POLICIES = {
    "dns-test": f"""
sandbox: {{name: dns-test}}
network:
  dns:
    allow: {ALLOWED_NAMES}
  https:
    allow:
      - host: api.example.net
        methods: [GET]
""",
    "dns-private": f"""
sandbox: {{name: dns-private}}
network:
  allow_private: [10.0.0.0/8]
  dns:
    allow: {ALLOWED_NAMES}
""",
    "dns-budget": """
sandbox: {name: dns-budget}
network:
  dns:
    allow: ["*.budget.example.com"]
    budget: {queries: 3, name_bytes: 200}
""",
    "dns-refused": """
sandbox: {name: dns-refused}
network:
  dns:
    allow: [txt.example.com, allowed.example.com]
    deny_rcode: REFUSED
    query_types: [A, AAAA, TXT]
""",
    "dns-rate": """
sandbox: {name: dns-rate}
network:
  dns:
    allow: [allowed.example.com]
    budget: {per_second: 2}
""",
}


class RecordingSink:
    """An AuditSink that keeps events in memory; `fail_writes` makes write() raise like a broken disk,
    `unhealthy` makes healthy() report the failure state the real sinks report after one."""

    def __init__(self) -> None:
        self.events: list[AuditEvent] = []
        self.fail_writes = False
        self.unhealthy = False

    async def write(self, event: AuditEvent) -> None:
        if self.fail_writes:
            raise AuditUnavailable("test sink: disk full")
        self.events.append(event)

    def healthy(self) -> bool:
        return not self.unhealthy

    async def close(self) -> None:
        return None


async def ask(
    server: DnsServer,
    name: str,
    qtype: str = "A",
    source: str = SANDBOX_IP,
    *,
    tcp: bool = False,
    edns: int | None = 1232,
    timeout: float = 3.0,
) -> dns.message.Message:
    """One query with dnspython from `source` (the sandbox's address)."""
    query = dns.message.make_query(name, qtype, use_edns=edns is not None, payload=edns or 512)
    host, port = server.address
    if tcp:
        return await dns.asyncquery.tcp(query, host, port=port, source=source, timeout=timeout)
    return await dns.asyncquery.udp(query, host, port=port, source=source, timeout=timeout, ignore_trailing=False)


def addresses(response: dns.message.Message) -> list[str]:
    return sorted(
        rd.address for rrset in response.answer for rd in rrset if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)
    )


def rcode(response: dns.message.Message) -> str:
    return dns.rcode.to_text(response.rcode())


async def raw_udp(server: DnsServer, packet: bytes, source: str = SANDBOX_IP, timeout: float = 0.5) -> bytes | None:
    """Send raw bytes; the reply or None when the server stayed silent."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[bytes] = loop.create_future()

    class Proto(asyncio.DatagramProtocol):
        def datagram_received(self, data, addr):
            if not future.done():
                future.set_result(data)

    transport, _ = await loop.create_datagram_endpoint(Proto, local_addr=(source, 0), remote_addr=server.address)
    try:
        transport.sendto(packet)
        return await asyncio.wait_for(future, timeout)
    except TimeoutError:
        return None
    finally:
        transport.close()


async def dig(server: DnsServer, *args: str, source: str = SANDBOX_IP) -> str:
    host, port = server.address
    proc = await asyncio.create_subprocess_exec(
        "dig",
        f"@{host}",
        "-p",
        str(port),
        "-b",
        source,
        "+time=2",
        "+tries=1",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 15)
    return out.decode() + err.decode()
