"""A transparently redirected sandbox inside the test world (for test_transparent.py).

What a runtime adapter does for a real sandbox, reduced to what the gateway's transparent listener needs:
a namespace `tsb` (198.18.5.2, no firewall of its own, default route via gw) whose every TCP connection
is DNATed, in gw, to the gateway's transparent listener on 127.0.0.1 (`route_localnet` on the veth makes
that legal), and nothing is forwarded for it. So the only thing between a `tsb` client and the world's
canaries is the gateway itself: a bug that dialed the original destination would hit the canary.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tests.networld as nw
from tests.networld import World
from tests.support.http1 import Response, read_response
from tests.support.netgateway import Gateway, Sandbox

T = TypeVar("T")

GW_TSB, TSB = "198.18.5.1", "198.18.5.2"
UNKNOWN_SOURCE = "198.18.5.3"  # on the tsb link, registered to no sandbox
REVOKED_SOURCE = "198.18.5.4"  # registered to a sandbox that the tests revoke
LIMITED_SOURCE = "198.18.5.5"  # registered to a sandbox used by the connection-limit test
TABLE = "egT_transparent"


@dataclass
class Transparent:
    world: World
    gateway: Gateway
    ns: str
    ifname: str
    sbx: Sandbox
    table: str = TABLE

    @classmethod
    def create(cls, world: World, gateway: Gateway, tag: str = "tsb", net: str = "198.18.5",
               table: str = TABLE) -> Transparent:
        """The `tag` namespace on `net`.0/24: .1 gw side, .2 the sandbox admitted here, .3-.5 the extra
        source addresses (UNKNOWN/REVOKED/LIMITED_SOURCE, shifted to `net`); DNAT to `gateway`."""
        ns, ifname = world.add_namespace(tag, f"{net}.1", f"{net}.2")
        for last in (3, 4, 5):
            nw.sh("ip", "-n", ns, "addr", "add", f"{net}.{last}/32", "dev", f"{nw.PREFIX}{world.sid}{tag}b")
        host, port = gateway.transparent
        nw.sh("ip", "netns", "exec", world.gw, "sysctl", "-qw", f"net.ipv4.conf.{ifname}.route_localnet=1")
        ruleset = (
            f"table ip {table} {{\n"
            f"  chain egt_pre {{ type nat hook prerouting priority -100; policy accept;\n"
            f"    iifname \"{ifname}\" ip protocol tcp dnat to {host}:{port}\n  }}\n"
            f"  chain egt_fwd {{ type filter hook forward priority 0; policy accept;\n"
            f"    iifname \"{ifname}\" drop\n    oifname \"{ifname}\" drop\n  }}\n}}\n"
        )
        nw.sh("ip", "netns", "exec", world.gw, "nft", "-f", "-", input=ruleset)
        sbx = gateway.admit("escape-transparent", address=f"{net}.2")
        return cls(world=world, gateway=gateway, ns=ns, ifname=ifname, sbx=sbx, table=table)

    def close(self) -> None:
        nw.sh("ip", "netns", "exec", self.world.gw, "nft", "delete", "table", "ip", self.table, check=False)

    def in_tsb(self, fn: Callable[[], T]) -> T:
        return self.world.in_ns(self.ns, fn)

    def connect(self, dst: str, port: int, source: str | None = None) -> socket.socket:
        """A TCP connection from tsb to `dst:port` (which the DNAT hands to the gateway)."""
        def make() -> socket.socket:
            return socket.create_connection((dst, port), timeout=10,
                                            source_address=(source, 0) if source else None)
        return self.in_tsb(make)

    def tls(self, sock: socket.socket, sni: str | None, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLSocket:
        """TLS presenting `sni` (None: no SNI), trusting the gateway CA; names unchecked (the point is
        what the gateway does with the SNI, not what the client accepts)."""
        return self.gateway.tls(sock, sni, alpn)

    def request(self, sock: socket.socket | ssl.SSLSocket, host: str | None, path: str = "/",
                method: str = "GET", target: str | None = None) -> Response:
        head = f"{method} {target or path} HTTP/1.1\r\n"
        if host is not None:
            head += f"Host: {host}\r\n"
        sock.sendall((head + "Connection: close\r\n\r\n").encode())
        return read_response(sock)

    def https(self, dst: str, sni: str | None, host: str | None, port: int = 443, path: str = "/",
              source: str | None = None) -> Response:
        with self.tls(self.connect(dst, port, source), sni) as tsock:
            return self.request(tsock, host, path)

    def http(self, dst: str, host: str | None, port: int = 80, path: str = "/",
             source: str | None = None) -> Response:
        with self.connect(dst, port, source) as sock:
            return self.request(sock, host, path)


UPSTREAM = nw.UPSTREAM
