"""The world's DNS server: asyncio UDP+TCP, dnslib for parse/pack only, answers the test controls.

Run by tests/networld as ``ip netns exec NS python dnsserver.py SPEC.json``. Answers come from a JSON
file re-read on every query (the test rewrites it atomically): static answers, TTL 0 by default, and
rotating answers for DNS rebinding (each query for a name/type gets the next answer set). Every query is
logged with the querier's address, so a test can tell the gateway's queries from anyone else's and can
prove an exfiltrating name never arrived. Prints ``READY`` once both sockets are bound.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import sys
from pathlib import Path
from typing import Any

from listen import JsonLog  # same directory: this file runs as a script


class DnsControl:
    """Answers from a JSON file the test rewrites at will; rotation counters live in the server."""

    def __init__(self, control: str, log: JsonLog) -> None:
        self.control = Path(control)
        self.log = log
        self.counters: dict[tuple[str, str], int] = {}

    def answer(self, data: bytes, peer: str = "") -> bytes | None:
        from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord

        try:
            request = DNSRecord.parse(data)
        except Exception as exc:  # garbage on the wire: log and drop, like a real server
            self.log.write(event="dns_garbage", error=repr(exc))
            return None
        reply = request.reply()
        table = json.loads(self.control.read_text())
        ttl = int(table.get("ttl", 0))
        for q in request.questions:
            qname = str(q.qname).rstrip(".").lower()
            qtype = QTYPE[q.qtype]
            entry = table["records"].get(qname)
            answers: list[str] = []
            if entry is None:
                reply.header.rcode = RCODE.NXDOMAIN
            else:
                value = entry.get(qtype, [])
                if isinstance(value, dict):  # {"rotate": [[...], [...]]}
                    key = (qname, qtype)
                    idx = self.counters.get(key, 0)
                    self.counters[key] = idx + 1
                    answers = value["rotate"][idx % len(value["rotate"])]
                else:
                    answers = value
                for addr in answers:
                    rdata = AAAA(tuple(ipaddress.IPv6Address(addr).packed)) if qtype == "AAAA" else A(addr)
                    reply.add_answer(RR(q.qname, q.qtype, rdata=rdata, ttl=ttl))
            rcode = int(reply.header.rcode)
            self.log.write(event="query", qname=qname, qtype=qtype, answers=answers, rcode=rcode, peer=peer)
        return reply.pack()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, ctl: DnsControl) -> None:
        self.ctl = ctl
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        out = self.ctl.answer(data, f"{addr[0]}:{addr[1]}")
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)


async def run_dns(spec: dict[str, Any]) -> None:
    ctl = DnsControl(spec["control"], JsonLog(spec["log"]))
    loop = asyncio.get_running_loop()
    host, port = spec["host"], int(spec["port"])
    await loop.create_datagram_endpoint(lambda: _Udp(ctl), local_addr=(host, port))

    async def tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(2), "big")
                peer = writer.get_extra_info("peername")
                out = ctl.answer(await reader.readexactly(size), f"{peer[0]}:{peer[1]}" if peer else "")
                if out is None:
                    break
                writer.write(len(out).to_bytes(2, "big") + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(tcp, host, port)
    print("READY", flush=True)
    async with server:
        await server.serve_forever()



if __name__ == "__main__":
    os.umask(0o022)
    asyncio.run(run_dns(json.loads(Path(sys.argv[1]).read_text())))
