"""The closed network world `make bench` runs in: four network namespaces it creates and deletes.

    egB-<id>-sw   a bridge (br0), nothing else; the switch between the three below
    egB-<id>-cli  198.18.0.1/24   the load generator (the bench driver itself runs here)
    egB-<id>-gw   198.18.0.2/24   the proxies under test: Squid, bare mitmdump, egressgate
    egB-<id>-up   198.18.0.3/24   the upstream (loadtests/upstream.py), named `upstream.bench.test`

Why namespaces, not loopback: client, proxies and upstream then talk over real (virtual) links, as in a
deployment, and a proxy cannot shortcut to the upstream through `lo`. Why nothing else: every veth is created
inside the switch namespace with its peer moved straight into its namespace, so no interface, route or
address ever exists in the host's namespace; the namespaces have no default route, so a stray packet to
any address outside 198.18.0.0/24 has nowhere to go (network safety: traffic stays in 198.18.0.0/15).

Name resolution: `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts, so the proxies resolve
the upstream's name through their ordinary resolvers (getaddrinfo for mitmproxy and egressgate, Squid's own
hosts_file). The file is ours (named after our namespace) and removed with the world.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "egB"
NET = "198.18.0.0/15"  # RFC 2544 benchmarking range: the only addresses the bench uses besides loopback
ADDR = {"cli": "198.18.0.1", "gw": "198.18.0.2", "up": "198.18.0.3"}
UPSTREAM_NAME = "upstream.bench.test"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class World:
    """The namespaces of one bench run; `ns(role)` names them, `exec_prefix(role)` runs a command inside."""

    tag: str

    @classmethod
    def create(cls) -> World:
        world = cls(f"{PREFIX}-{secrets.token_hex(3)}")
        try:
            world._build()
        except Exception:
            world.destroy()
            raise
        return world

    def ns(self, role: str) -> str:
        return f"{self.tag}-{role}"

    def exec_prefix(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(role)]

    def _build(self) -> None:
        sw = self.ns("sw")
        for role in ("sw", *ADDR):
            _ip("netns", "add", self.ns(role))
            _ip("-n", self.ns(role), "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for role, addr in ADDR.items():
            # created in the switch namespace, peer moved at once: nothing ever appears in the host namespace
            port = f"v-{role}"
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", self.ns(role))
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", self.ns(role), "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", self.ns(role), "link", "set", "eth0", "up")
        hosts = Path("/etc/netns") / self.ns("gw")
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts").write_text(f"127.0.0.1 localhost\n{ADDR['up']} {UPSTREAM_NAME}\n")

    def destroy(self) -> None:
        """Kill what still runs in our namespaces (only there: `ip netns pids`), delete them and the hosts file."""
        for role in (*ADDR, "sw"):
            ns = self.ns(role)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        shutil.rmtree(Path("/etc/netns") / self.ns("gw"), ignore_errors=True)
