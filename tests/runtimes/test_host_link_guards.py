"""The host veth's guards at the kernel level: source-address spoofing, and what route_localnet exposes.

In transparent mode and for DNS the gateway identifies a sandbox by its source address, so a workload
that can forge one (root with CAP_NET_RAW/CAP_NET_ADMIN in some runtime) must not get a packet with any
other source through its veth. These tests build the real plumbing (`Plumbing.attach`, the host table of
runtimes/nftables.py) between two throwaway namespaces, then, as root inside the sandbox namespace (what
`nsenter` does: setns), write raw IPv4/UDP packets with a forged source to the resolver's DNAT port and
watch the "resolver" (a UDP socket on the host namespace's 127.0.0.1, like the gateway's) for them.

Positive controls in the same test: the sandbox's own address gets through, and the forged packets DO
reach the listener once the anti-spoofing rule is deleted and rp_filter relaxed (so the test can fail).
"""

from __future__ import annotations

import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes import nftables
from egressgate.runtimes.base import GatewayEndpoints, SandboxAddress
from egressgate.runtimes.plumbing import Plumbing, in_netns, write_sysctl

HOST_IP, SANDBOX_IP = "198.18.96.1", "198.18.96.2"
# another sandbox's address (the next /30), and loopback (route_localnet=1 is set on the host veth)
FORGED = ["198.18.96.6", "127.0.0.1", "198.18.96.1"]


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def udp_packet(src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    """A whole IPv4+UDP datagram with a source address of our choosing (IP_HDRINCL)."""
    length = 8 + len(payload)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, socket.IPPROTO_UDP, length)
    udp = struct.pack("!HHHH", sport, dport, length, 0) + payload
    udp = udp[:6] + struct.pack("!H", checksum(pseudo + udp) or 0xFFFF) + udp[8:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + length, 0x1234, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    return ip + udp


def send_raw(packets: list[bytes]) -> None:
    """In the sandbox namespace, as root: the sandbox's own (defence-in-depth) table deleted first, then a
    raw socket with our own IP header: only the host table stands in the way."""
    subprocess.run(["nft", "delete", "table", "inet", nftables.SANDBOX_TABLE], check=False, timeout=30,
                   capture_output=True)
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    try:
        for pkt in packets:
            s.sendto(pkt, (HOST_IP, 0))
    finally:
        s.close()


def received(sock: socket.socket, timeout: float = 1.0) -> dict[bytes, str]:
    """payload → source address of every datagram the listener got within `timeout`."""
    sock.settimeout(timeout)
    out: dict[bytes, str] = {}
    while True:
        try:
            data, peer = sock.recvfrom(2048)
        except TimeoutError:
            return out
        out[data] = peer[0]
        sock.settimeout(0.2)


@pytest.fixture
def link() -> Iterator[tuple[str, str, SandboxAddress, Plumbing, socket.socket]]:
    tag = uuid.uuid4().hex[:8]
    host_ns, sandbox_ns = f"egV-h{tag}", f"egV-s{tag}"
    for ns in (host_ns, sandbox_ns):
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    host_path, sandbox_path = f"/run/netns/{host_ns}", f"/run/netns/{sandbox_ns}"
    try:
        def host_setup() -> socket.socket:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=30)
            # the positive control must be about OUR rule: the namespace default, stated
            write_sysctl("net.ipv4.conf.all.rp_filter", "0")
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            return s

        listener = in_netns(host_path, host_setup)
        port = listener.getsockname()[1]
        gw = GatewayEndpoints(proxy=("127.0.0.1", 1), transparent=("127.0.0.1", 2), dns=("127.0.0.1", port),
                              admin=("127.0.0.1", 3))
        address = SandboxAddress(HOST_IP, SANDBOX_IP, 30, f"egVh{tag}", f"egVs{tag}")
        plumbing = Plumbing(f"egV{tag}", address, gw)
        in_netns(host_path, lambda: plumbing.attach(sandbox_path))
        yield host_path, sandbox_path, address, plumbing, listener
        listener.close()
    finally:
        for ns in (host_ns, sandbox_ns):
            subprocess.run(["ip", "netns", "del", ns], check=False, timeout=30)


@pytest.mark.netns
def test_a_forged_source_address_never_reaches_the_resolver(link) -> None:
    host_path, sandbox_path, address, plumbing, listener = link
    legit = udp_packet(SANDBOX_IP, HOST_IP, 40000, 53, b"legit")
    forged = [udp_packet(src, HOST_IP, 40000, 53, b"forged " + src.encode()) for src in FORGED]

    # the resolver's real port and DoT/mDNS ports on the host address: only port 53 is DNATed to it
    port = listener.getsockname()[1]
    direct = [udp_packet(SANDBOX_IP, HOST_IP, 40000, p, b"direct %d" % p) for p in (port, 853, 5353)]

    in_netns(sandbox_path, lambda: send_raw([legit, *forged, *direct]))
    got = received(listener)
    assert got == {b"legit": SANDBOX_IP}, got  # the sandbox's own address works; nothing forged arrives
    counts = in_netns(host_path, lambda: nftables.drop_counts(plumbing.table))
    assert counts["spoofed"] == len(FORGED), counts
    assert counts["udp"] == len(direct), counts

    # positive control: without the anti-spoofing rule and with rp_filter off, the same packets DO reach
    # the listener, under the forged identities (the test above could fail)
    def remove_protection() -> None:
        listing = subprocess.run(["nft", "-a", "list", "chain", "inet", plumbing.table, "raw_pre"],
                                 capture_output=True, text=True, check=True, timeout=30).stdout
        handle = next(line.rsplit("# handle ", 1)[1] for line in listing.splitlines() if "drop_spoofed" in line
                      and "# handle" in line)
        subprocess.run(["nft", "delete", "rule", "inet", plumbing.table, "raw_pre", "handle", handle],
                       check=True, timeout=30)
        write_sysctl(f"net.ipv4.conf.{address.host_if}.rp_filter", "0")

    in_netns(host_path, remove_protection)
    in_netns(sandbox_path, lambda: send_raw(forged))
    got = received(listener)
    leaked = {src for src in FORGED if got.get(b"forged " + src.encode()) == src}
    # another sandbox's address gets through; loopback and the host's own address are also refused by the
    # kernel's martian/local-source checks, so for them our rule is the first layer, not the only one
    assert leaked == {"198.18.96.6"}, got


@pytest.mark.netns
def test_strict_rp_filter_is_set_on_the_host_veth(link) -> None:
    host_path, _sandbox_path, address, _plumbing, _listener = link
    value = in_netns(host_path, Path(f"/proc/sys/net/ipv4/conf/{address.host_if}/rp_filter").read_text)
    assert value.strip() == "1"


class Listener:
    """A TCP listener in the host namespace that records the connections it accepts (with their original
    destination, SO_ORIGINAL_DST, when they were DNATed)."""

    def __init__(self, host_path: str, addr: str) -> None:
        def make() -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((addr, 0))
            s.listen(16)
            return s

        self.sock = in_netns(host_path, make)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[tuple[str, int]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _peer = self.sock.accept()
            except OSError:
                return
            try:
                raw = conn.getsockopt(socket.SOL_IP, 80, 16)  # SO_ORIGINAL_DST
                port, ip = struct.unpack("!2xH4s8x", raw)
                self.accepted.append((socket.inet_ntoa(ip), port))
            except OSError:
                self.accepted.append(conn.getsockname())
            conn.close()

    def close(self) -> None:
        self.sock.close()


def connect_all(targets: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
    out = {}
    for target in targets:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(target)
                out[target] = "connected"
            except OSError as exc:
                out[target] = type(exc).__name__
    return out


@pytest.mark.netns
def test_route_localnet_exposes_nothing_on_loopback_but_the_listeners(link) -> None:
    """route_localnet=1 on the host veth (needed to DNAT to 127.0.0.1) must not expose the admin API or
    anything else bound to 127/8. The attacker is root in the sandbox namespace with every capability: it
    deletes the sandbox's own nftables, turns route_localnet on at its end and routes 127/8 out of its veth,
    so its packets arrive at the host addressed to 127.0.0.1/127.0.0.2 (and to the host end's address)."""
    host_path, sandbox_path, address, plumbing, _dns = link
    transparent = Listener(host_path, "127.0.0.1")
    admin = Listener(host_path, "127.0.0.1")
    canary = Listener(host_path, "127.0.0.1")
    canary2 = Listener(host_path, "127.0.0.2")
    in_netns(host_path, plumbing.detach)  # re-attach with the transparent listener of this test
    gw = GatewayEndpoints(proxy=("127.0.0.1", 1), transparent=("127.0.0.1", transparent.port),
                          dns=plumbing.gateway.dns, admin=("127.0.0.1", admin.port))
    plumbing = Plumbing(plumbing.run_id, address, gw)
    in_netns(host_path, lambda: plumbing.attach(sandbox_path))

    def take_over() -> None:
        subprocess.run(["nft", "delete", "table", "inet", nftables.SANDBOX_TABLE], check=True, timeout=30)
        for scope in ("all", address.sandbox_if):
            write_sysctl(f"net.ipv4.conf.{scope}.route_localnet", "1")
        subprocess.run(["ip", "addr", "flush", "dev", "lo"], check=True, timeout=30)
        subprocess.run(["ip", "link", "set", "lo", "down"], check=True, timeout=30)
        subprocess.run(["ip", "route", "add", "127.0.0.0/8", "via", HOST_IP, "dev", address.sandbox_if],
                       check=True, timeout=30)

    in_netns(sandbox_path, take_over)
    targets = [("127.0.0.1", admin.port), ("127.0.0.1", canary.port), ("127.0.0.2", canary2.port),
               (HOST_IP, admin.port), (HOST_IP, canary.port)]
    try:
        result = in_netns(sandbox_path, lambda: connect_all(targets))
        # every attempt ended at the transparent listener (which decides on a name and denies), none at
        # the admin API or a canary
        deadline = time.monotonic() + 3  # the accept thread records asynchronously
        while len(transparent.accepted) < len(targets) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert admin.accepted == [] and canary.accepted == [] and canary2.accepted == [], result
        assert sorted(transparent.accepted) == sorted(targets), (result, transparent.accepted)

        # positive control: without the host table, route_localnet alone lets the sandbox reach them
        in_netns(host_path, lambda: nftables.delete_table(plumbing.table))
        result = in_netns(sandbox_path, lambda: connect_all(targets[:3]))
        assert result == dict.fromkeys(targets[:3], "connected"), result
        deadline = time.monotonic() + 3
        while not (admin.accepted and canary.accepted and canary2.accepted) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert admin.accepted and canary.accepted and canary2.accepted
    finally:
        for item in (transparent, admin, canary, canary2):
            item.close()
