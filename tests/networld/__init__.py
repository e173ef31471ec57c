"""A disposable, closed network world for adversarial egress tests (root + ``ip netns``).

Why it exists: a test about a forbidden destination (the metadata endpoint, 10.x, loopback, WireServer)
must never send a byte to the real one. So every forbidden address is a *canary server inside a namespace
this module creates*; nothing in the world has a link to the machine's real network, and the gateway
under test runs inside it too. A gateway bug therefore lands on a canary that logs the TCP accept, and
the test asserts "canary untouched" (plus a positive control proving the canary is live and reachable).

Topology (names are unique per world: ``eg<sid>-gw`` ...)::

    sbx  198.18.3.2  ──veth──  198.18.3.1  gw  198.18.0.1  ──veth──  198.18.0.2  net
    open 198.18.4.2  ──veth──  198.18.4.1  (gateway runs here,        (canaries, upstreams, DNS on lo:
                                            loopback canary            169.254.169.254 10.0.0.5
                                            127.0.0.1:80/443)          100.100.100.200 168.63.129.16
                                                                       fd00:ec2::254 64:ff9b::a9fe:a9fe
                                                                       2002:a9fe:a9fe::1 ::a9fe:a9fe
                                                                       2001:0:4136:e378:8000:63bf:5601:5601
                                                                       198.18.1.10
                                                                       198.18.1.20 198.18.0.53)

``gw`` forwards packets, so the only thing between ``sbx`` and the canaries is the nftables ruleset in
``sbx`` (output policy drop, except the gateway proxy address:port): that is the no-bypass property
under test. ``open`` is the same position *without* nftables: the positive control that a direct path
would have reached the canaries. Cleanup runs on close (also after failures); a world left behind by a
killed session is removed by the next one (its owner pid is recorded in ``/run/egressgate-networld``).

Use::

    with world(tmp_path) as w:                  # or World.create(tmp) ... w.close()
        mark = w.mark()
        w.curl(w.gw, "http://169.254.169.254/")   # runs inside the gw namespace
        assert w.canary_hits(mark)                # the metadata canary logged the accept
        w.set_dns({"x.evil.test": {"A": {"rotate": [["198.18.1.10"], ["127.0.0.1"]]}}})
        w.allow_sandbox_to("198.18.3.1", 8080)    # open the sandbox firewall for one listener
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trustme

from tests.networld.plan import (
    CERT_NAMES,
    DEFAULT_DNS,
    DNS_ADDR,
    FORBIDDEN_UPSTREAM,
    GW_CANARIES,
    GW_NET,
    GW_OPEN,
    GW_SBX,
    GW_SELF_CANARY_PORT,
    NET_CANARIES,
    NET_GW,
    OPEN,
    SBX,
    UPSTREAM,
    UPSTREAMS,
    V6,
)
from tests.support import cli
from tests.support.zygote import EGRESSGATE

__all__ = [
    "CERT_NAMES", "DEFAULT_DNS", "DNS_ADDR", "FORBIDDEN_UPSTREAM", "GW_CANARIES", "GW_NET", "GW_OPEN", "GW_SBX",
    "GW_SELF_CANARY_PORT", "NET_CANARIES", "NET_GW", "OPEN", "PREFIX", "REGISTRY", "SBX", "UPSTREAM", "UPSTREAMS",
    "V6", "Mark", "World", "destroy_namespaces", "reap_stale_worlds", "sh", "world",
]

HERE = Path(__file__).resolve().parent
LISTEN_SERVER = HERE / "listen.py"
DNS_SERVER = HERE / "dnsserver.py"
REGISTRY = Path("/run/egressgate-networld")
PREFIX = "egw"

T = TypeVar("T")


def sh(
    *args: str, check: bool = True, timeout: float = 30, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a setup command; failures raise with the command's stderr (setup must never half-succeed)."""
    res = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, input=input,
                         check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Mark:
    """Offsets into the hit logs; ``World.hits(since=mark)`` returns only what arrived afterwards."""

    offsets: dict[str, int]


@dataclass
class World:
    """One disposable world. Create with ``World.create(tmp_dir)``; always ``close()`` it."""

    tmp: Path
    sid: str = field(default_factory=lambda: secrets.token_hex(3))
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # namespaces added by add_namespace()
    _files: list[Any] = field(default_factory=list)
    ca: trustme.CA = field(default_factory=trustme.CA)

    # ------------------------------------------------------------------------------ names and paths
    @property
    def gw(self) -> str:
        return f"{PREFIX}{self.sid}-gw"

    @property
    def net(self) -> str:
        return f"{PREFIX}{self.sid}-net"

    @property
    def sbx(self) -> str:
        return f"{PREFIX}{self.sid}-sbx"

    @property
    def open(self) -> str:
        return f"{PREFIX}{self.sid}-open"

    @property
    def namespaces(self) -> list[str]:
        return [self.gw, self.net, self.sbx, self.open, *self.extra]

    def add_namespace(self, tag: str, gw_addr: str, addr: str) -> tuple[str, str]:
        """One more namespace linked to gw (`addr`/24, gw side `gw_addr`/24, default route via gw), with no
        firewall of its own; registered with the world, so close() and a later session's reaper remove
        it. Returns (namespace, gw-side interface name)."""
        ns = f"{PREFIX}{self.sid}-{tag}"
        self.extra.append(ns)
        self._register()
        sh("ip", "netns", "add", ns)
        etc = Path("/etc/netns") / ns  # like _build: a resolver inside the world only
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(f"nameserver {DNS_ADDR}\n")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        ia, ib = f"{PREFIX}{self.sid}{tag}a", f"{PREFIX}{self.sid}{tag}b"
        sh("ip", "link", "add", ia, "netns", self.gw, "type", "veth", "peer", "name", ib, "netns", ns)
        sh("ip", "-n", self.gw, "addr", "add", f"{gw_addr}/24", "dev", ia)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ib)
        for n, ifc in ((self.gw, ia), (ns, ib)):
            sh("ip", "-n", n, "link", "set", ifc, "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", gw_addr)
        return ns, ia

    @property
    def ca_pem(self) -> Path:
        return self.tmp / "ca.pem"

    @property
    def dns_control(self) -> Path:
        return self.tmp / "dns-control.json"

    def log_path(self, which: str) -> Path:
        return self.tmp / f"hits-{which}.jsonl"

    # ------------------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, tmp: Path) -> World:
        reap_stale_worlds()
        world = cls(tmp=tmp)
        try:
            world._build()
        except BaseException:
            world.close()
            raise
        return world

    def _register(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "namespaces": self.namespaces}
        (REGISTRY / f"{self.sid}.json").write_text(json.dumps(record))

    def _build(self) -> None:
        self._register()
        for ns in self.namespaces:
            sh("ip", "netns", "add", ns)
            etc = Path("/etc/netns") / ns  # `ip netns exec` bind-mounts these: a resolver inside the world
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text(f"nameserver {DNS_ADDR}\n")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        self._link(self.gw, GW_NET, V6["gw_net"], self.net, NET_GW, V6["net_gw"], "n")
        self._link(self.gw, GW_SBX, V6["gw_sbx"], self.sbx, SBX, V6["sbx"], "s")
        self._link(self.gw, GW_OPEN, V6["gw_open"], self.open, OPEN, V6["open"], "o")
        for ns, via, via6 in ((self.sbx, GW_SBX, V6["gw_sbx"]), (self.open, GW_OPEN, V6["gw_open"]),
                              (self.gw, NET_GW, V6["net_gw"])):
            sh("ip", "-n", ns, "route", "add", "default", "via", via)
            sh("ip", "-n", ns, "-6", "route", "add", "default", "via", via6)
        for dst in ("198.18.3.0/24", "198.18.4.0/24"):
            sh("ip", "-n", self.net, "route", "add", dst, "via", GW_NET)
        for dst in ("2001:2:0:3::/64", "2001:2:0:4::/64"):  # no default: net is a dead end
            sh("ip", "-n", self.net, "-6", "route", "add", dst, "via", V6["gw_net"])
        for key in ("net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"):
            sh("ip", "netns", "exec", self.gw, "sysctl", "-qw", key)
        net_addrs = {a for a, _, _ in NET_CANARIES.values()} | {DNS_ADDR, UPSTREAM, FORBIDDEN_UPSTREAM}
        for addr in sorted(net_addrs):
            family = ("-6",) if ":" in addr else ()
            plen = "/128" if ":" in addr else "/32"
            extra = ("nodad",) if ":" in addr else ()
            sh("ip", "-n", self.net, *family, "addr", "add", addr + plen, "dev", "lo", *extra)
        self._sandbox_firewall()
        self._certs()
        self.set_dns(DEFAULT_DNS)
        self._start_servers()

    def _link(self, ns_a: str, a4: str, a6: str, ns_b: str, b4: str, b6: str, tag: str) -> None:
        ia, ib = f"{PREFIX}{self.sid}{tag}a", f"{PREFIX}{self.sid}{tag}b"
        sh("ip", "link", "add", ia, "netns", ns_a, "type", "veth", "peer", "name", ib, "netns", ns_b)
        for ns, ifc, v4, v6 in ((ns_a, ia, a4, a6), (ns_b, ib, b4, b6)):
            sh("ip", "-n", ns, "addr", "add", f"{v4}/24", "dev", ifc)
            sh("ip", "-n", ns, "-6", "addr", "add", f"{v6}/64", "dev", ifc, "nodad")
            sh("ip", "-n", ns, "link", "set", ifc, "up")

    def _sandbox_firewall(self) -> None:
        """sbx may talk only to elements of @gateway (the proxy address:port, added once it listens).

        Everything else is rejected (not silently dropped) so a bypass attempt fails in milliseconds
        instead of a connect timeout; either way no packet leaves the sandbox namespace.
        """
        ruleset = (
            "table inet egw_sandbox {\n"
            "  set gateway { type ipv4_addr . inet_service; }\n"
            "  chain out {\n    type filter hook output priority 0; policy drop;\n"
            "    oifname \"lo\" accept\n    ct state established,related accept\n"
            "    meta l4proto { tcp, udp } ip daddr . th dport @gateway accept\n"
            "    counter reject with icmpx type admin-prohibited\n  }\n"
            "  chain in {\n    type filter hook input priority 0; policy drop;\n"
            "    iifname \"lo\" accept\n    ct state established,related accept\n  }\n}\n"
        )
        sh("ip", "netns", "exec", self.sbx, "nft", "-f", "-", input=ruleset)

    def allow_sandbox_to(self, addr: str, port: int) -> None:
        """Open the sandbox firewall for one gateway listener, TCP and UDP (the DNS listener), nothing else."""
        sh("ip", "netns", "exec", self.sbx, "nft", "add", "element", "inet", "egw_sandbox", "gateway",
           f"{{ {addr} . {port} }}")

    def _certs(self) -> None:
        self.ca.cert_pem.write_to_path(str(self.ca_pem))
        leaf = self.ca.issue_cert(*CERT_NAMES)
        leaf.cert_chain_pems[0].write_to_path(str(self.tmp / "server.pem"))
        leaf.private_key_pem.write_to_path(str(self.tmp / "server.key"))

    def _spawn(self, ns: str, role: str, spec: dict[str, Any], name: str) -> None:
        spec_path = self.tmp / f"spec-{name}.json"
        spec_path.write_text(json.dumps(spec))
        stderr = open(self.tmp / f"{name}.stderr", "w")  # noqa: SIM115 - closed in close()
        self._files.append(stderr)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(LISTEN_SERVER if role == "listen" else DNS_SERVER),
             str(spec_path)],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
        self.procs.append(proc)
        line = _readline_timeout(proc, 15)
        if line.strip() != "READY":
            err = (self.tmp / f"{name}.stderr").read_text()
            raise RuntimeError(f"world server {name} did not start: {line!r} {err[-2000:]}")

    def _start_servers(self) -> None:
        cert = {"cert": str(self.tmp / "server.pem"), "key": str(self.tmp / "server.key")}

        def canaries(table: dict[str, tuple[str, int, bool]]) -> list[dict[str, Any]]:
            return [{"name": n, "host": a, "port": p, "tls": t, "banner": f"CANARY:{n}"}
                    for n, (a, p, t) in table.items()]

        self._spawn(self.net, "listen", {"log": str(self.log_path("net")), **cert,
                                         "listeners": canaries(NET_CANARIES) + UPSTREAMS}, "net-listen")
        self._spawn(self.gw, "listen", {"log": str(self.log_path("gw")), **cert,
                                        "listeners": canaries(GW_CANARIES)}, "gw-listen")
        self._spawn(self.net, "dns", {"log": str(self.log_path("dns")), "control": str(self.dns_control),
                                      "host": DNS_ADDR, "port": 53}, "dns")

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for fh in [*self._files, *(p.stdout for p in self.procs if p.stdout)]:
            fh.close()
        destroy_namespaces(self.namespaces)
        with contextlib.suppress(FileNotFoundError):
            (REGISTRY / f"{self.sid}.json").unlink()

    # ------------------------------------------------------------------------------ running things
    def exec(
        self, ns: str, *args: str, timeout: float = 20, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside a namespace of this world (never raises on a non-zero exit). An `egressgate`
        command is forked from the test fork server (tests/support/cli.run: as `ip netns exec` runs it)."""
        if args[:1] == (EGRESSGATE,) and input is None:
            return cli.run(list(args), netns=ns, timeout=timeout)
        return subprocess.run(["ip", "netns", "exec", ns, *args], capture_output=True, text=True,
                              timeout=timeout, input=input, check=False)

    def curl(self, ns: str, *args: str, timeout: float = 15) -> subprocess.CompletedProcess[str]:
        """curl inside ``ns`` with a hard time limit; the world's CA is trusted."""
        return self.exec(ns, "curl", "-gsS", "--max-time", str(int(timeout) - 2), "--cacert", str(self.ca_pem),
                         *args, timeout=timeout)

    def popen(self, ns: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", ns, *args], text=True, **kw)

    def in_ns(self, ns: str, fn: Callable[[], T]) -> T:
        """Call ``fn`` in a thread that has joined ``ns``; sockets it creates stay in ``ns`` afterwards."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                with open(f"/run/netns/{ns}") as fh:
                    os.setns(fh.fileno(), os.CLONE_NEWNET)
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(60)
        if "error" in box:
            raise box["error"]
        return box["value"]

    # ------------------------------------------------------------------------------ DNS control
    def set_dns(self, records: dict[str, dict[str, Any]], ttl: int = 0) -> None:
        """Replace the test resolver's answers atomically (``{"name": {"A": [...]}}``, or rotate)."""
        tmp = self.dns_control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"ttl": ttl, "records": records}))
        tmp.replace(self.dns_control)

    # ------------------------------------------------------------------------------ observing hits
    def mark(self) -> Mark:
        return Mark({w: _size(self.log_path(w)) for w in ("net", "gw", "dns")})

    def hits(self, since: Mark | None = None, listener: str | None = None,
             which: tuple[str, ...] = ("net", "gw")) -> list[dict[str, Any]]:
        """Every record the world's servers logged (optionally since a mark, for one listener)."""
        out: list[dict[str, Any]] = []
        for w in which:
            path = self.log_path(w)
            if not path.exists():
                continue
            with open(path, "rb") as fh:
                fh.seek(since.offsets.get(w, 0) if since else 0)
                data = fh.read()  # a line without its newline is still being written by the server
                out += [json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines() if line.strip()]
        return [r for r in out if listener is None or r.get("listener") == listener]

    def canary_hits(self, since: Mark | None = None) -> list[dict[str, Any]]:
        names = set(NET_CANARIES) | set(GW_CANARIES)
        return [r for r in self.hits(since) if r.get("listener") in names]

    def dns_queries(self, since: Mark | None = None) -> list[dict[str, Any]]:
        return [r for r in self.hits(since, which=("dns",)) if r.get("event") == "query"]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _readline_timeout(proc: subprocess.Popen[str], timeout: float) -> str:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""),
                              daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


def destroy_namespaces(namespaces: list[str]) -> None:
    """Kill what still runs inside our namespaces (by pid), then delete them and their /etc/netns."""
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def reap_stale_worlds() -> None:
    """Remove worlds whose owning test process died without cleaning up (SIGKILL, OOM)."""
    if not REGISTRY.is_dir():
        return
    for entry in REGISTRY.glob("*.json"):
        try:
            record = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(int(record.get("pid", 0))):
            continue
        destroy_namespaces([ns for ns in record.get("namespaces", []) if ns.startswith(PREFIX)])
        entry.unlink(missing_ok=True)


@contextlib.contextmanager
def world(tmp: Path) -> Iterator[World]:
    """``with world(tmp) as w:`` — the world is torn down whatever happens inside."""
    w = World.create(tmp)
    try:
        yield w
    finally:
        w.close()
