"""The DNS listener: UDP and TCP on the same address and port, asyncio only.

Why not dnslib's servers: they are thread-per-request socketservers; one slow upstream would tie up a thread
per query. Here every query is a task on the gateway's event loop, bounded in number:
- UDP: at most `udp_max_inflight` queries in progress (`udp_max_inflight_per_client` per source address);
  beyond that datagrams are dropped and counted (a client retries; a flood does not grow memory, and one
  sandbox cannot take every slot). Answers larger than the client's limit go out truncated with TC.
- TCP (RFC 7766): two-byte length prefix, many messages per connection, pipelined (answers may leave out of
  order, each with its query id), at most `tcp_max_inflight` per connection (the reader waits, so a client
  that does not read its answers stalls only itself), an idle timeout, and caps on connections in total and
  per source address (beyond them new connections are closed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct

from egressgate.audit.sink import AuditSink
from egressgate.dns.config import DnsConfig, DnsConfigError
from egressgate.dns.metrics import DnsMetrics
from egressgate.dns.resolver import PolicyLookup, Resolver
from egressgate.dns.wire import SERVFAIL, bare_response
from egressgate.state.base import StateStore

_BIND_ATTEMPTS = 20


def client_ip(peer: tuple | None) -> str:
    """Canonical text of the peer address, as runtimes register it (IPv4-mapped IPv6 becomes IPv4)."""
    if not peer:
        return ""
    host = peer[0]
    if ":" not in host:
        return host
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


class _UdpListener:
    """Datagrams read in batches straight from a non-blocking socket.

    Why not a DatagramProtocol: asyncio's datagram transport reads one datagram per readiness event, i.e. one
    epoll_wait per query. Reading until EAGAIN (at most BATCH per wakeup) and starting each query's task eagerly
    (it runs synchronously until its first real wait) keeps the per-query overhead to the work itself.
    """

    BATCH = 64

    def __init__(self, server: DnsServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.tasks: set[asyncio.Task[None]] = set()
        self.per_client: dict[str, int] = {}  # queries in progress per source address
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._bufsize = server.config.max_query_size + 1  # one byte more, so oversize is still visible
        self.loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        metrics = self.server.metrics
        cap = self.server.config.udp_max_inflight
        per_client = self.server.config.udp_max_inflight_per_client
        for _ in range(self.BATCH):
            try:
                data, addr = self.sock.recvfrom(self._bufsize)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                metrics.dropped_malformed += 1
                return
            source = addr[0]
            busy = self.per_client.get(source, 0)
            if len(self.tasks) >= cap or busy >= per_client:
                metrics.dropped_overload += 1
                continue
            self.per_client[source] = busy + 1
            task = asyncio.Task(self._answer(data, addr), loop=self.loop, eager_start=True)
            if not task.done():
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _answer(self, data: bytes, addr: tuple) -> None:
        try:
            answer = await self.server.resolver.handle(data, client_ip(addr), udp=True)
        finally:
            left = self.per_client[addr[0]] - 1
            if left:
                self.per_client[addr[0]] = left
            else:
                del self.per_client[addr[0]]
        if answer is None or self.closed:
            return
        try:
            self.sock.sendto(answer, addr)
        except OSError:  # EAGAIN (send buffer full) or the client is gone: UDP may lose it, the client retries
            self.server.metrics.udp_send_failed += 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()


def _udp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_dns(host: str, port: int) -> tuple[socket.socket, socket.socket]:
    """Bind UDP and TCP on the same port (port 0: a free one both protocols can have) and listen.

    Split from `DnsServer.start` so `egressgate run --workers N` (gateway/service/workers.py) can bind the pair
    once in the supervisor and hand the same sockets to every worker."""
    last_error: OSError | None = None
    for _ in range(_BIND_ATTEMPTS if port == 0 else 1):
        udp = _udp_socket(host, port)
        bound = udp.getsockname()
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            tcp = socket.create_server((host, bound[1]), family=family, backlog=100)
        except OSError as exc:  # the UDP port's TCP twin is taken: try another port
            udp.close()
            last_error = exc
            continue
        tcp.setblocking(False)
        return udp, tcp
    raise last_error or OSError(f"cannot bind DNS listener on {host}:{port}")


class DnsServer:
    """`await start(host, port)` -> bound (host, port); `await stop()`. One instance per listener address."""

    def __init__(
        self,
        policies: PolicyLookup,
        state: StateStore,
        audit: AuditSink,
        config: DnsConfig | None = None,
        metrics: DnsMetrics | None = None,
    ) -> None:
        self.config = (config or DnsConfig()).validate()
        self.metrics = metrics or DnsMetrics()
        self.resolver = Resolver(policies, state, audit, self.config, self.metrics)
        self._udp: _UdpListener | None = None
        self._tcp: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._per_client: dict[str, int] = {}  # open TCP connections per source address
        self._tcp_tasks: set[asyncio.Task[None]] = set()
        self.address: tuple[str, int] | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 5353,
                    sockets: tuple[socket.socket, socket.socket] | None = None) -> tuple[str, int]:
        """Serve on `sockets` (UDP, TCP: bound by `bind_dns`, e.g. in the workers' supervisor), or bind
        UDP and TCP on `host`:`port` now."""
        sock, tcp = sockets if sockets is not None else bind_dns(host, port)
        bound = sock.getsockname()
        if (bound[0], bound[1]) in self.resolver.upstream.servers:
            # resolv.conf naming this very listener: every allowed query would come back to us
            sock.close()
            tcp.close()
            raise DnsConfigError(f"upstream {bound[0]}:{bound[1]} is this resolver's own listener")
        self._tcp = await asyncio.start_server(self._serve_tcp, sock=tcp)
        self._udp = _UdpListener(self, sock)
        self.address = (bound[0], bound[1])
        return self.address

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for writer in list(self._connections):
            writer.close()
        tasks = [*(self._udp.tasks if self._udp else ()), *self._tcp_tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._tcp is not None:
            with contextlib.suppress(Exception):
                await self._tcp.wait_closed()
        self._udp = None
        self._tcp = None

    # --- TCP -----------------------------------------------------------------------------------------

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = client_ip(writer.get_extra_info("peername"))
        if (
            len(self._connections) >= self.config.tcp_max_connections
            or self._per_client.get(client, 0) >= self.config.tcp_max_per_client
        ):
            self.metrics.tcp_rejected += 1
            writer.close()
            return
        self.metrics.tcp_connections += 1
        self._connections.add(writer)
        self._per_client[client] = self._per_client.get(client, 0) + 1
        slots = asyncio.Semaphore(self.config.tcp_max_inflight)
        pending: set[asyncio.Task[None]] = set()
        try:
            while not writer.is_closing():  # closed by us (a client that does not read) or by the peer
                try:
                    async with asyncio.timeout(self.config.tcp_idle_timeout):
                        (length,) = struct.unpack("!H", await reader.readexactly(2))
                        data = await reader.readexactly(length)
                except TimeoutError:
                    self.metrics.tcp_idle_closed += 1
                    break
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                await slots.acquire()
                task = asyncio.get_running_loop().create_task(self._tcp_answer(data, client, writer, slots))
                pending.add(task)
                self._tcp_tasks.add(task)
                task.add_done_callback(pending.discard)
                task.add_done_callback(self._tcp_tasks.discard)
            if pending:  # answer what was asked before the client stopped sending
                await asyncio.wait(pending, timeout=self.config.upstream_timeout * 3 + 1)
        finally:
            self._connections.discard(writer)
            left = self._per_client[client] - 1
            if left:
                self._per_client[client] = left
            else:
                del self._per_client[client]
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _tcp_answer(
        self, data: bytes, client: str, writer: asyncio.StreamWriter, slots: asyncio.Semaphore
    ) -> None:
        try:
            answer = await self.resolver.handle(data, client, udp=False)
            if answer is None or writer.is_closing():
                return
            if len(answer) > 65535:
                answer = bare_response(answer[0] << 8 | answer[1], 0, SERVFAIL, b"")
            writer.write(struct.pack("!H", len(answer)) + answer)
            try:
                async with asyncio.timeout(self.config.tcp_idle_timeout):
                    await writer.drain()
            except TimeoutError:
                # The client sends but does not read: its answers pile up. Drop the connection rather than
                # hold a slot (and buffered answers) forever.
                self.metrics.tcp_idle_closed += 1
                writer.transport.abort()
            except ConnectionError:
                pass
        finally:
            slots.release()
