"""Plumbing.attach/release/detach against the real kernel, in two namespaces this test creates (a
stand-in for the gateway's and the sandbox's): the start-up work now runs partly concurrently
(runtimes/plumbing.py), and these are the properties that must survive it — when `attach` returns,
both sides are complete (host table, route_localnet, no IPv6 anywhere, the sandbox's own table and
route); after `release` + `detach` nothing of the run is left in either namespace."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes import nftables, records
from egressgate.runtimes.base import GatewayEndpoints, SandboxAddress
from egressgate.runtimes.plumbing import Plumbing, in_netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")

ENDPOINTS = GatewayEndpoints(proxy=("127.0.0.1", 8080), transparent=("127.0.0.1", 8082), dns=("127.0.0.1", 5353),
                             admin=("127.0.0.1", 8081))


def sh(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, *args], capture_output=True, text=True, check=False,
                          timeout=30)


def sysctl(ns: str, key: str) -> str:
    return sh(ns, "cat", "/proc/sys/" + key.replace(".", "/")).stdout.strip()


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    gw, sb = f"egP-gw-{os.getpid()}", f"egP-sb-{os.getpid()}"
    for ns in (gw, sb):
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    subprocess.run(["ip", "-n", gw, "link", "set", "lo", "up"], check=True, timeout=30)  # the listeners' side
    try:
        yield gw, sb
    finally:
        for ns in (gw, sb):
            subprocess.run(["ip", "netns", "del", ns], check=False, timeout=30)


def test_attach_completes_both_sides_and_teardown_leaves_nothing(namespaces: tuple[str, str]) -> None:
    gw, sb = namespaces
    run_id = records.new_run_id()
    a = SandboxAddress(host_ip="198.18.200.1", sandbox_ip="198.18.200.2", prefix_len=30, host_if=f"egh{run_id}",
                       sandbox_if=f"egs{run_id}")
    plumbing = Plumbing(run_id, a, ENDPOINTS)
    in_netns(f"/run/netns/{gw}", lambda: plumbing.attach(f"/run/netns/{sb}"))

    # host side ("gateway" namespace): the run's table, the link with its address, localnet on it only
    assert sh(gw, "nft", "list", "table", "inet", nftables.table_name(run_id)).returncode == 0
    host_addrs = json.loads(sh(gw, "ip", "-j", "addr", "show", "dev", a.host_if).stdout)
    assert [(i["family"], i["local"]) for i in host_addrs[0]["addr_info"]] == [("inet", a.host_ip)]
    assert sysctl(gw, f"net.ipv4.conf.{a.host_if}.route_localnet") == "1"
    assert sysctl(gw, f"net.ipv6.conf.{a.host_if}.disable_ipv6") == "1"
    # sandbox side: IPv6 off everywhere (no address of any scope), its own table, the default route
    for scope in ("all", "default", "lo", a.sandbox_if):
        assert sysctl(sb, f"net.ipv6.conf.{scope}.disable_ipv6") == "1", scope
    assert sh(sb, "ip", "-6", "addr").stdout.strip() == ""
    assert sh(sb, "nft", "list", "table", "inet", nftables.SANDBOX_TABLE).returncode == 0
    assert f"default via {a.host_ip} dev {a.sandbox_if}" in sh(sb, "ip", "route").stdout
    # the link works: TCP from the sandbox is DNATed to the (absent) transparent listener and reset
    probe = (f"import socket\ntry:\n    socket.create_connection(('{a.host_ip}', 80), 3)\n"
             "except OSError as e:\n    print(type(e).__name__)")
    assert sh(sb, "python3", "-c", probe).stdout.strip() == "ConnectionRefusedError"
    # UDP other than DNS is refused by the sandbox's own table (EPERM to the sender) and counted there
    udp = (f"import socket\ntry:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
           f"('{a.host_ip}', 443))\nexcept OSError as e:\n    print(type(e).__name__)")
    assert sh(sb, "python3", "-c", udp).stdout.strip() == "PermissionError"

    counts = in_netns(f"/run/netns/{gw}", plumbing.release)
    assert counts.get("udp", 0) >= 1  # the datagram above
    in_netns(f"/run/netns/{gw}", plumbing.detach)
    in_netns(f"/run/netns/{gw}", plumbing.detach)  # idempotent
    assert a.host_if not in sh(gw, "ip", "-o", "link").stdout
    assert a.sandbox_if not in sh(sb, "ip", "-o", "link").stdout
    assert nftables.table_name(run_id) not in sh(gw, "nft", "list", "tables").stdout


def test_detach_without_release_still_removes_the_veth_before_the_table(namespaces: tuple[str, str]) -> None:
    """A run that failed before `release` (or gc-like use) still gets a complete detach."""
    gw, sb = namespaces
    run_id = records.new_run_id()
    a = SandboxAddress(host_ip="198.18.200.5", sandbox_ip="198.18.200.6", prefix_len=30, host_if=f"egh{run_id}",
                       sandbox_if=f"egs{run_id}")
    plumbing = Plumbing(run_id, a, ENDPOINTS)
    in_netns(f"/run/netns/{gw}", lambda: plumbing.attach(f"/run/netns/{sb}"))
    assert a.host_if in sh(gw, "ip", "-o", "link").stdout  # positive control
    in_netns(f"/run/netns/{gw}", plumbing.detach)
    assert a.host_if not in sh(gw, "ip", "-o", "link").stdout
    assert nftables.table_name(run_id) not in sh(gw, "nft", "list", "tables").stdout
    assert Path(f"/run/netns/{sb}").exists()  # the namespace itself is the adapter's, untouched
