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
"""

from __future__ import annotations

import asyncio
import socket

from mitmproxy.proxy import mode_servers

from egressgate.config import ListenConfig, parse_listen
from egressgate.dns.server import bind_dns

BACKLOG = 1024  # one accept queue for every worker: larger than asyncio's default of 100

_ORIGINAL_LISTEN = mode_servers.AsyncioServerInstance.listen
_INHERITED: dict[tuple[str, int], socket.socket] = {}


def _tcp_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    sock.setblocking(False)
    return sock


def bind_all(listen: ListenConfig) -> dict[str, socket.socket]:
    """Bind every configured listener: `proxy`, `admin`, `transparent`, `dns_udp` + `dns_tcp` (one port).
    Anything already bound is closed again when a later bind fails (the caller reports the OSError)."""
    socks: dict[str, socket.socket] = {}
    key = "proxy"
    try:
        socks["proxy"] = _tcp_listener(*parse_listen(listen.proxy))
        key = "admin"
        socks["admin"] = _tcp_listener(*parse_listen(listen.admin))
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


async def _listen(self, host: str, port: int) -> list:
    """mitmproxy's `AsyncioServerInstance.listen`, serving an inherited socket when one matches."""
    sock = _INHERITED.get((host, port))
    if sock is None or self.mode.transport_protocol != "tcp":
        return await _ORIGINAL_LISTEN(self, host, port)
    # a duplicate: mitmproxy closes its server on stop (and on a reconfigure), the inherited one stays
    return [await asyncio.start_server(self.handle_stream, sock=sock.dup())]


def install_mitm(socks: list[socket.socket]) -> None:
    """Serve mitmproxy listeners on these sockets (matched by their bound host and port)."""
    for sock in socks:
        host, port = sock.getsockname()[:2]
        _INHERITED[(host, port)] = sock
    mode_servers.AsyncioServerInstance.listen = _listen  # type: ignore[method-assign]
