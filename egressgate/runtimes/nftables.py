"""The nftables rules that make the gateway a sandbox's only way out. Text builders are pure (tested
table-driven in tests/runtimes/test_nftables.py); `apply`/`delete_table` run `nft -f -` once.

Host side, one `table inet egressgate_<run_id>` per run in the gateway's network namespace, keyed on the
run's host veth (`iifname`; a name match works before the interface exists, so the table goes in first
and there is no instant in which the link exists without its rules). The sandbox cannot touch it: it
lives in another namespace and the workload has no CAP_NET_ADMIN.

* raw prerouting: IPv6 dropped; any source address but the sandbox's own dropped (anti-spoofing: in
  transparent mode and for DNS the source address IS the identity, so a workload that can forge it, root
  with CAP_NET_ADMIN/CAP_NET_RAW in some runtime, would get another sandbox's policy and audit trail;
  127/8 sources too, in front of the kernel's martian checks); everything but TCP and UDP dropped (ICMP,
  SCTP, raw IP protocols);
  UDP other than port 53 dropped (QUIC, other resolvers, anything tunnelled over UDP).
* nat prerouting: TCP to <host_ip>:<proxy port> → the explicit proxy; TCP and UDP port 53 to ANY
  address → our resolver (a "public" resolver gets our answers); every other TCP → the transparent
  listener (refused with a reset when the gateway runs none). Listeners bound to loopback are reachable
  through DNAT because plumbing sets route_localnet=1 on the host veth only.
* filter input: only connections DNATed to exactly those listeners are accepted (so route_localnet
  does not expose the admin API or anything else bound to 127/8); the rest is dropped.
* filter forward: nothing is routed to or from the veth (no way around the gateway with ip_forward=1).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess

from egressgate.runtimes.base import GatewayEndpoints, SandboxAddress

TABLE_PREFIX = "egressgate_"
# named counters of what the host table refused; read at teardown into the revocation's audit record
# (egressgate.run.dropped.*), because a packet the kernel drops never reaches the gateway's audit trail
DROP_COUNTERS = ("ipv6", "spoofed", "not_tcp_udp", "udp", "tcp", "other")
SANDBOX_TABLE = "egressgate_sandbox"


def table_name(run_id: str) -> str:
    return TABLE_PREFIX + run_id


def dnat_target(listener: tuple[str, int], what: str) -> tuple[str, int]:
    """Where to DNAT for a listener: a wildcard bind is reached on 127.0.0.1; IPv6 listeners cannot be
    the target of an IPv4 DNAT (the sandbox link is IPv4 only), which is a setup error, not a fallback."""
    host, port = listener
    addr = ipaddress.ip_address(host)
    if addr.version != 4:
        if addr.is_unspecified:
            return "127.0.0.1", port
        raise ValueError(f"the gateway's {what} listener is {host} (IPv6); sandbox links are IPv4: bind it "
                         "to an IPv4 address (e.g. 127.0.0.1) or 0.0.0.0")
    return ("127.0.0.1" if addr.is_unspecified else host), port


def host_ruleset(run_id: str, address: SandboxAddress, gw: GatewayEndpoints) -> str:
    """The host-side table of one run (see the module docstring for why each rule exists)."""
    ifname = address.host_if
    proxy = dnat_target(gw.proxy, "proxy")
    dns = dnat_target(gw.dns, "dns")
    transparent = dnat_target(gw.transparent, "transparent") if gw.transparent else None
    allowed = [f"{proxy[0]} . tcp . {proxy[1]}", f"{dns[0]} . tcp . {dns[1]}", f"{dns[0]} . udp . {dns[1]}"]
    if transparent:
        allowed.append(f"{transparent[0]} . tcp . {transparent[1]}")
        other_tcp = f'    iifname "{ifname}" meta l4proto tcp dnat ip to {transparent[0]}:{transparent[1]}\n'
    else:
        other_tcp = ""  # not DNATed: reaches forward/input below and is refused there
    table = table_name(run_id)
    counters = "".join(f"  counter drop_{name} {{ }}\n" for name in DROP_COUNTERS)
    return (
        f"table inet {table} {{\n"
        f"{counters}"
        f"  chain raw_pre {{\n    type filter hook prerouting priority raw; policy accept;\n"
        f'    iifname "{ifname}" meta nfproto != ipv4 counter name "drop_ipv6" drop\n'
        f'    iifname "{ifname}" ip saddr != {address.sandbox_ip} counter name "drop_spoofed" drop\n'
        f'    iifname "{ifname}" meta l4proto != {{ tcp, udp }} counter name "drop_not_tcp_udp" drop\n'
        f'    iifname "{ifname}" udp dport != 53 counter name "drop_udp" drop\n'
        f"  }}\n"
        f"  chain nat_pre {{\n    type nat hook prerouting priority dstnat; policy accept;\n"
        f'    iifname "{ifname}" ip daddr {address.host_ip} tcp dport {proxy[1]} dnat ip to {proxy[0]}:{proxy[1]}\n'
        f'    iifname "{ifname}" meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {dns[0]}:{dns[1]}\n'
        f"{other_tcp}"
        f"  }}\n"
        f"  chain input {{\n    type filter hook input priority filter; policy accept;\n"
        f'    iifname "{ifname}" ct status dnat ip daddr . meta l4proto . th dport {{ {", ".join(allowed)} }} accept\n'
        f'    iifname "{ifname}" meta l4proto tcp counter name "drop_tcp" reject with tcp reset\n'
        f'    iifname "{ifname}" counter name "drop_other" drop\n'
        f"  }}\n"
        f"  chain forward {{\n    type filter hook forward priority filter; policy accept;\n"
        f'    iifname "{ifname}" meta l4proto tcp counter name "drop_tcp" reject with tcp reset\n'
        f'    iifname "{ifname}" counter name "drop_other" drop\n'
        f'    oifname "{ifname}" drop\n'
        f"  }}\n"
        f"}}\n"
    )


def sandbox_ruleset(address: SandboxAddress) -> str:
    """Inside the sandbox namespace, defence in depth (the host table is the control): out of the
    sandbox link only IPv4 TCP and UDP/53, nothing else on any interface but loopback. The workload
    has no CAP_NET_ADMIN to change it. It refuses first (EPERM to the sender), so it counts what it
    refuses under the same names as the host table; `drop_counts` adds both."""
    ifname = address.sandbox_if
    counters = "".join(f"  counter drop_{name} {{ }}\n" for name in DROP_COUNTERS)
    return (
        f"table inet {SANDBOX_TABLE} {{\n"
        f"{counters}"
        f"  chain output {{\n    type filter hook output priority filter; policy drop;\n"
        f'    oifname "lo" accept\n'
        f'    meta nfproto != ipv4 counter name "drop_ipv6" drop\n'
        f'    oifname "{ifname}" meta l4proto tcp accept\n'
        f'    oifname "{ifname}" udp dport 53 accept\n'
        f'    meta l4proto udp counter name "drop_udp" drop\n'
        f'    meta l4proto tcp counter name "drop_tcp" drop\n'
        f'    meta l4proto != {{ tcp, udp }} counter name "drop_not_tcp_udp" drop\n'
        f"  }}\n"
        f"}}\n"
    )


def apply(ruleset: str) -> None:
    """Load a ruleset atomically (one `nft -f -`: all of it or nothing) in the caller's netns."""
    res = subprocess.run(["nft", "-f", "-"], input=ruleset, capture_output=True, text=True, check=False,
                         timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"nft -f failed ({res.returncode}): {res.stderr.strip()}")


def drop_counts(name: str) -> dict[str, int]:
    """Packets each DROP_COUNTERS rule of table `name` (in the caller's netns) refused; empty when the
    table is gone."""
    res = subprocess.run(["nft", "-j", "list", "counters", "table", "inet", name], capture_output=True,
                         text=True, check=False, timeout=30)
    if res.returncode != 0:
        return {}
    out: dict[str, int] = {}
    for item in json.loads(res.stdout).get("nftables", []):
        counter = item.get("counter")
        name = str((counter or {}).get("name", "")).removeprefix("drop_")
        if counter and name in DROP_COUNTERS:
            out[name] = int(counter.get("packets", 0))
    return out


def delete_table(name: str) -> bool:
    """Delete one of our tables; False when it did not exist (idempotent teardown)."""
    if not name.startswith(TABLE_PREFIX):
        raise ValueError(f"refusing to delete a table that is not ours: {name!r}")
    res = subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True, text=True, check=False,
                         timeout=30)
    return res.returncode == 0


def list_tables() -> list[str]:
    """Names of our `inet egressgate_*` tables in the caller's netns (for `sandbox gc`)."""
    res = subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True, check=False,
                         timeout=30)
    out = []
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "table" and parts[2].startswith(TABLE_PREFIX):
            out.append(parts[2])
    return out
