"""A scripted DNS server on loopback for the gateway's resolver tests: real UDP and TCP sockets, playing a
hostile or broken upstream per name (truncated UDP answers, forged replies with a wrong id, question, QR
bit or source, records for another owner, silence, a TCP leg that hangs). `log` records every query
(transport, name, qtype) so tests can show what the client really asked.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from dataclasses import dataclass, field

from dnslib import AAAA, CNAME, QTYPE, RR, A, DNSQuestion, DNSRecord

CANARY = "127.0.0.2"
REAL = "127.0.0.1"


@dataclass
class Plan:
    """How the scripted server answers one name."""

    records: list[tuple[str, str, str]] = field(default_factory=list)  # (owner, type, value); "" = qname
    ttl: int = 30
    rcode: int = 0
    mode: str = "udp"  # udp | tc (UDP says truncated, TCP answers) | silent | tc-hang (TCP never answers)
    forge: str | None = None  # id | question | source | qr | control: a reply naming CANARY sent first
    tcp_forge: bool = False  # on TCP, a wrong-id reply naming CANARY precedes the real one
    delay: float = 0.0  # seconds before the real reply (UDP and TCP)


class ScriptedDns:
    """UDP + TCP DNS server on 127.0.0.1 in a loop thread; `log` lists (transport, name, qtype)."""

    def __init__(self) -> None:
        self.plans: dict[str, Plan] = {}
        self.log: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()  # its own loop thread: the tests themselves are synchronous
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port, self.spoof_port = self._run(self._start())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _start(self) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        server = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr) -> None:
                server._udp(self.transport, data, addr)

        # UDP and TCP on one port number: the port the kernel picked for UDP may be taken for TCP by
        # another process on this machine, so try again with a fresh one.
        for attempt in range(50):
            self.udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=(REAL, 0))
            try:
                self.tcp = await asyncio.start_server(self._tcp, REAL, self.udp.get_extra_info("sockname")[1])
                break
            except OSError:
                self.udp.close()
                if attempt == 49:
                    raise
        # a second socket on the same address: datagrams from here have the wrong source port
        self.spoof, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=(REAL, 0))
        return self.udp.get_extra_info("sockname")[1], self.spoof.get_extra_info("sockname")[1]

    def close(self) -> None:
        async def stop() -> None:
            self.udp.close()
            self.spoof.close()
            self.tcp.close()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def queries(self, name: str, transport: str | None = None, qtype: str = "A") -> int:
        with self.lock:
            return sum(1 for t, n, q in self.log if n == name and q == qtype and transport in (None, t))

    def _reply(self, request: DNSRecord, plan: Plan | None, addresses: list[tuple[str, str]] | None = None):
        reply = request.reply()
        q = request.q
        qtype = QTYPE[q.qtype]
        if plan is None:
            reply.header.rcode = 3
            return reply
        reply.header.rcode = plan.rcode
        for owner, rtype, value in addresses if addresses is not None else plan.records:
            name = owner or str(q.qname)
            if rtype == "CNAME":
                reply.add_answer(RR(name, QTYPE.CNAME, rdata=CNAME(value), ttl=plan.ttl))
            elif rtype == qtype == "A":
                reply.add_answer(RR(name, QTYPE.A, rdata=A(value), ttl=plan.ttl))
            elif rtype == qtype == "AAAA":
                reply.add_answer(RR(name, QTYPE.AAAA, rdata=AAAA(value), ttl=plan.ttl))
        return reply

    def _udp(self, transport, data: bytes, addr) -> None:
        request = DNSRecord.parse(data)
        name, qtype = str(request.q.qname).rstrip(".").lower(), QTYPE[request.q.qtype]
        with self.lock:
            self.log.append(("udp", name, qtype))
        plan = self.plans.get(name)
        if plan is not None and plan.mode == "silent":
            return
        if plan is not None and plan.forge and qtype == "A":
            forged = self._reply(request, plan, [("", "A", CANARY)])
            sender = transport
            if plan.forge == "id":
                forged.header.id = (request.header.id + 1) % 65536
            elif plan.forge == "question":
                forged.questions = [DNSQuestion("evil." + name, QTYPE.A)]  # reply() shares q
                forged.rr = [RR("evil." + name, QTYPE.A, rdata=A(CANARY), ttl=plan.ttl)]
            elif plan.forge == "qr":
                forged.header.qr = 0
            elif plan.forge == "source":
                sender = self.spoof
            sender.sendto(forged.pack(), addr)
        reply = self._reply(request, plan)
        if plan is not None and plan.mode in ("tc", "tc-hang"):
            reply.rr = []
            reply.header.tc = 1
        delay = plan.delay if plan is not None else 0.0
        # the real reply leaves after the forged one (and after `delay`)
        asyncio.get_running_loop().call_later(max(delay, 0.05 if plan and plan.forge else 0), transport.sendto,
                                              reply.pack(), addr)

    async def _tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                request = DNSRecord.parse(await reader.readexactly(length))
                name, qtype = str(request.q.qname).rstrip(".").lower(), QTYPE[request.q.qtype]
                with self.lock:
                    self.log.append(("tcp", name, qtype))
                plan = self.plans.get(name)
                if plan is not None and plan.mode == "tc-hang":
                    await reader.read()  # hold the connection open, answer nothing
                    return
                if plan is not None and plan.tcp_forge and qtype == "A":
                    forged = self._reply(request, plan, [("", "A", CANARY)])
                    forged.header.id = (request.header.id + 1) % 65536
                    packed = forged.pack()
                    writer.write(struct.pack("!H", len(packed)) + packed)
                if plan is not None and plan.delay:
                    await asyncio.sleep(plan.delay)
                packed = self._reply(request, plan).pack()
                writer.write(struct.pack("!H", len(packed)) + packed)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
