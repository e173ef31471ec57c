"""Listening sockets bound once by the supervisor of `egressgate run --workers N` and shared by its workers.

Why inherited sockets rather than SO_REUSEPORT: mitmproxy 12.3.1 binds each listener itself
(`AsyncioServerInstance.listen` calls `asyncio.start_server(handler, host, port)`, no reuse_port), so
either way the worker's bind has to be replaced. With SO_REUSEPORT every worker owns a separate accept
queue: connections the kernel already queued on a worker that dies are reset, and until that socket is
closed the kernel keeps hashing new connections to it; "port 0" would also give every worker another
port. One socket bound by the supervisor and inherited by every worker has ONE accept queue: a dead
worker loses only the connections it had accepted, the survivors take every new one at once, the port
never closes while the supervisor lives (restarts included), and port 0 means one port for all.
The same holds for the DNS UDP socket (every worker reads datagrams from one queue), DNS TCP and admin.

The worker side: `inherit` rebuilds the sockets from the descriptor numbers the supervisor passed, and
`install_mitm` makes mitmproxy serve a mode whose (host, port) has an inherited socket on that socket
instead of binding (any other mode binds as before, so `--workers 1` is unchanged).

Why the proxy listeners accept ONE connection per readiness event (`SharedAccept`) instead of asyncio's
server: every worker is woken for a new connection, and asyncio's accept loop then takes up to 100 queued
connections at once, so a burst (32 keep-alive clients connecting together) all went to whichever
worker woke first (measured: 32 of 32) and a second worker added nothing. Taking one per wakeup lets
the other workers take theirs; a busy worker comes back to the queue later, so it naturally takes fewer.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Awaitable, Callable

from mitmproxy.proxy import mode_servers

from egressgate.config import ListenConfig, parse_listen
from egressgate.dns.server import bind_dns

logger = logging.getLogger(__name__)

BACKLOG = 1024  # one accept queue for every worker: larger than asyncio's default of 100

_ORIGINAL_LISTEN = mode_servers.AsyncioServerInstance.listen
_INHERITED: dict[tuple[str, int], socket.socket] = {}


def _tcp_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    sock.setblocking(False)
    return sock


def bind_all(listen: ListenConfig) -> dict[str, socket.socket]:
    """Bind every configured listener: `proxy`, `admin`, `metrics`, `transparent`, `dns_udp` + `dns_tcp` (one
    port).
    Anything already bound is closed again when a later bind fails (the caller reports the OSError)."""
    socks: dict[str, socket.socket] = {}
    key = "proxy"
    try:
        socks["proxy"] = _tcp_listener(*parse_listen(listen.proxy))
        key = "admin"
        socks["admin"] = _tcp_listener(*parse_listen(listen.admin))
        if listen.metrics is not None:
            key = "metrics"
            socks["metrics"] = _tcp_listener(*parse_listen(listen.metrics))
        if listen.transparent is not None:
            key = "transparent"
            socks["transparent"] = _tcp_listener(*parse_listen(listen.transparent))
        if listen.dns is not None:
            key = "dns"
            socks["dns_udp"], socks["dns_tcp"] = bind_dns(*parse_listen(listen.dns))
    except OSError as exc:
        close_all(socks)
        raise OSError(exc.errno, f"listen.{key} {getattr(listen, key)}: {exc.strerror or exc}") from exc
    except BaseException:
        close_all(socks)
        raise
    return socks


def close_all(socks: dict[str, socket.socket]) -> None:
    for sock in socks.values():
        sock.close()


def address(sock: socket.socket) -> str:
    """`host:port` (or `[v6]:port`) of a bound socket, as the config and the startup line spell it."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bound_listen(listen: ListenConfig, socks: dict[str, socket.socket]) -> ListenConfig:
    """The listen section with every port-0 address replaced by the port actually bound: what the
    workers are configured with, so each mode spec names exactly the inherited socket."""
    update = {"proxy": address(socks["proxy"]), "admin": address(socks["admin"])}
    if "transparent" in socks:
        update["transparent"] = address(socks["transparent"])
    if "metrics" in socks:
        update["metrics"] = address(socks["metrics"])
    if "dns_udp" in socks:
        update["dns"] = address(socks["dns_udp"])
    return listen.model_copy(update=update)


def descriptors(socks: dict[str, socket.socket]) -> dict[str, int]:
    return {kind: sock.fileno() for kind, sock in socks.items()}


def inherit(fds: dict[str, int]) -> dict[str, socket.socket]:
    """The worker's side: socket objects over the descriptors the supervisor passed (same numbers)."""
    socks = {}
    for kind, fd in fds.items():
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        socks[kind] = sock
    return socks


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class SharedAccept:
    """A stream server on a listening socket several processes share, taking one connection per
    readiness event (module docstring). What mitmproxy uses of a server: `sockets`, `close()`."""

    def __init__(self, sock: socket.socket, handler: Handler) -> None:
        self.loop = asyncio.get_running_loop()
        self.sockets = (sock,)
        self._sock = sock
        self._handler = handler
        self._tasks: set[asyncio.Task] = set()
        self._resume: asyncio.TimerHandle | None = None
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # another worker took it
        except OSError as exc:
            if exc.errno not in _OUT_OF_RESOURCES:
                raise
            # as asyncio's own server does: stop accepting for a second (the others keep accepting)
            logger.error("cannot accept on %s: %s; pausing this worker's accepts for 1 s", self._sock.getsockname(),
                         exc)
            self.loop.remove_reader(self._sock.fileno())
            self._resume = self.loop.call_later(1.0, self.loop.add_reader, self._sock.fileno(), self._accept)
            return
        task = self.loop.create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        reader = asyncio.StreamReader(limit=2**16)
        protocol = asyncio.StreamReaderProtocol(reader, self._handler)  # calls handler(reader, writer)
        try:
            await self.loop.connect_accepted_socket(lambda: protocol, conn)
        except OSError:
            conn.close()

    def close(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
        self.loop.remove_reader(self._sock.fileno())
        self._sock.close()


async def _listen(self, host: str, port: int) -> list:
    """mitmproxy's `AsyncioServerInstance.listen`, serving an inherited socket when one matches."""
    sock = _INHERITED.get((host, port))
    if sock is None or self.mode.transport_protocol != "tcp":
        return await _ORIGINAL_LISTEN(self, host, port)
    # a duplicate: mitmproxy closes its server on stop (and on a reconfigure), the inherited one stays
    return [SharedAccept(sock.dup(), self.handle_stream)]


def install_mitm(socks: list[socket.socket]) -> None:
    """Serve mitmproxy listeners on these sockets (matched by their bound host and port)."""
    for sock in socks:
        host, port = sock.getsockname()[:2]
        _INHERITED[(host, port)] = sock
    mode_servers.AsyncioServerInstance.listen = _listen  # type: ignore[method-assign]
