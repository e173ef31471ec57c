"""`runtime render firecracker`: a Firecracker VM config (--config-file JSON) and the host's nftables
script for the VM's tap device.

A microVM's only NIC is a tap on the host; the host side of that tap is the VM's default route. The
nftables table (one per VM, `inet egressgate_fc_<tap>`) makes the gateway the VM's only way out, with the
very rules the netns runtime applies to its veth (built by runtimes/nftables.py): on packets arriving from the tap,
IPv6 and everything but TCP/UDP is dropped, UDP other than port 53 is dropped (QUIC, other resolvers),
DNS (UDP and TCP 53, to ANY address) is sent to the gateway's resolver, TCP to the host address on the
proxy port to the explicit proxy, every other TCP to the transparent listener; the input hook accepts
only connections translated to exactly those listeners (so `route_localnet`, which the DNAT to
127.0.0.1 needs, exposes nothing else on 127/8: not the admin API); forwarding from or to the tap is
dropped, so even `ip_forward=1` routes nothing around the gateway.
The VM itself is untrusted: nothing here relies on the guest's configuration (its boot_args only make
the network come up without DHCP).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re

from egressgate.runtimes import nftables
from egressgate.runtimes.base import GatewayEndpoints, SandboxAddress
from egressgate.runtimes.render.common import RenderContext, RenderError

MAX_VCPUS = 32  # Firecracker's machine-config limit
DEFAULT_MEM_MIB = 512  # when the policy sets no memory_mb
_IFNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$")  # IFNAMSIZ - 1 bytes, no quoting needed in nft


def _endpoint(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    try:
        if not sep:
            raise ValueError
        address = ipaddress.ip_address(host)
        number = int(port)
        if address.version != 4 or not 0 < number < 65536:
            raise ValueError
    except ValueError:
        raise RenderError(f"{flag} must be IPV4:PORT of a gateway listener on the host, got {value!r}") from None
    return str(address), number


def tap_addresses(subnet: str) -> tuple[str, str, int]:
    """(host_ip, guest_ip, prefix) from a /30 (or larger: the first two host addresses are used)."""
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError as exc:
        raise RenderError(f"--subnet {subnet!r} is not a network address with prefix (e.g. 198.18.128.0/30): "
                          f"{exc}") from None
    if net.version != 4 or net.prefixlen > 30:
        raise RenderError(f"--subnet must be an IPv4 network of /30 or larger, got {subnet!r}")
    hosts = net.hosts()
    return str(next(hosts)), str(next(hosts)), net.prefixlen


def guest_mac(guest_ip: str) -> str:
    """A locally administered unicast MAC derived from the guest address (stable across renders)."""
    octets = ipaddress.ip_address(guest_ip).packed
    return "06:00:" + ":".join(f"{b:02x}" for b in octets)


def vm_config(ctx: RenderContext, *, tap: str, kernel: str, rootfs: str, workspace_image: str | None,
              host_ip: str, guest_ip: str, prefix: int) -> dict:
    res = ctx.resources
    vcpus = max(1, math.ceil(res.cpu_millis / 1000)) if res.cpu_millis else 1
    if vcpus > MAX_VCPUS:
        raise RenderError(f"sandbox.resources.cpu_millis {res.cpu_millis} needs {vcpus} vCPUs; "
                          f"Firecracker allows at most {MAX_VCPUS}")
    netmask = str(ipaddress.ip_network(f"0.0.0.0/{prefix}").netmask)
    # ip=<client>:<server>:<gateway>:<netmask>:<hostname>:<device>:<autoconf>:<dns0>
    ip_arg = f"ip={guest_ip}::{host_ip}:{netmask}:{ctx.name[:63]}:eth0:off:{host_ip}"
    drives = [{"drive_id": "rootfs", "path_on_host": rootfs, "is_root_device": True,
               "is_read_only": ctx.policy.model.sandbox.root_fs == "read_only"}]
    if workspace_image:
        drives.append({"drive_id": "workspace", "path_on_host": workspace_image, "is_root_device": False,
                       "is_read_only": False})
    return {
        "boot-source": {"kernel_image_path": kernel,
                        "boot_args": f"console=ttyS0 reboot=k panic=1 pci=off {ip_arg}"},
        "drives": drives,
        "machine-config": {"vcpu_count": vcpus, "mem_size_mib": res.memory_mb or DEFAULT_MEM_MIB, "smt": False},
        "network-interfaces": [{"iface_id": "eth0", "guest_mac": guest_mac(guest_ip), "host_dev_name": tap}],
    }


def nft_script(*, tap: str, host_ip: str, guest_ip: str, prefix: int, proxy: tuple[str, int],
               transparent: tuple[str, int], dns: tuple[str, int]) -> str:
    """The tap's ruleset: the netns runtime's host table (runtimes/nftables.py, where each rule and its
    reason is stated once) keyed on the tap instead of a veth, preceded by the create-then-delete idiom
    so `nft -f` can be re-run to replace the table. Every interpolated value was validated above."""
    run_id = "fc_" + re.sub(r"[^A-Za-z0-9_]", "_", tap)
    table = nftables.table_name(run_id)
    link = SandboxAddress(host_ip=host_ip, sandbox_ip=guest_ip, prefix_len=prefix, host_if=tap, sandbox_if="eth0")
    endpoints = GatewayEndpoints(proxy=proxy, transparent=transparent, dns=dns, admin=("127.0.0.1", 0))
    header = (f"# egressgate: the only way out of the VM behind tap {tap} is the gateway (docs/runtimes-deploy.md).\n"
              f"# Needs: sysctl -w net.ipv4.conf.{tap}.route_localnet=1 (DNAT to 127.0.0.1); the input chain keeps\n"
              "# every other loopback service (the admin API included) unreachable from the tap.\n"
              f"table inet {table}\ndelete table inet {table}\n")
    return header + nftables.host_ruleset(run_id, link, endpoints)


def render_firecracker(ctx: RenderContext, *, tap: str | None = None, subnet: str = "198.18.128.0/30",
                       kernel: str = "/var/lib/egressgate/firecracker/vmlinux",
                       rootfs: str = "/var/lib/egressgate/firecracker/rootfs.ext4",
                       workspace_image: str | None = None, proxy: str = "127.0.0.1:8080",
                       transparent: str = "127.0.0.1:8082", dns: str = "127.0.0.1:5353") -> dict[str, str]:
    """{file name: content}: vm.json (firecracker --config-file) and tap.nft (nft -f)."""
    tap = tap or ("egfc-" + re.sub(r"[^a-z0-9]", "", ctx.name))[:15]
    if not _IFNAME.match(tap):
        raise RenderError(f"--tap {tap!r} is not an interface name (1-15 of A-Z a-z 0-9 _ . -)")
    for label, path in (("--kernel", kernel), ("--rootfs", rootfs), ("--workspace-image", workspace_image)):
        if path is not None and not path.startswith("/"):
            raise RenderError(f"{label} must be an absolute path on the host, got {path!r}")
    host_ip, guest_ip, prefix = tap_addresses(subnet)
    config = vm_config(ctx, tap=tap, kernel=kernel, rootfs=rootfs, workspace_image=workspace_image,
                       host_ip=host_ip, guest_ip=guest_ip, prefix=prefix)
    script = nft_script(tap=tap, host_ip=host_ip, guest_ip=guest_ip, prefix=prefix,
                        proxy=_endpoint(proxy, "--gateway-proxy"),
                        transparent=_endpoint(transparent, "--gateway-transparent"),
                        dns=_endpoint(dns, "--gateway-dns"))
    return {"vm.json": json.dumps(config, indent=2) + "\n", "tap.nft": script}
