"""`runtime render firecracker`: the VM config has the fields Firecracker's config schema requires (and no
others), the resources come from the policy, and the tap's nftables script really leaves the "VM" no
way out but the gateway's listeners (a veth named like the tap stands in for it; the rules match on
the interface name only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from egressgate.runtimes.render.common import RenderError, load_context
from egressgate.runtimes.render.firecracker import render_firecracker
from tests.support.cli import POLICIES, cli

PEER = str(Path(__file__).with_name("fc_peer.py"))

# The subset of Firecracker's FullVmConfiguration (src/firecracker/swagger/firecracker.yaml) we emit,
# with its required fields and types; additionalProperties=false catches a misspelt key.
_STR = {"type": "string"}
FC_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["boot-source", "drives", "machine-config", "network-interfaces"],
    "properties": {
        "boot-source": {"type": "object", "additionalProperties": False, "required": ["kernel_image_path"],
                        "properties": {"kernel_image_path": _STR, "boot_args": _STR, "initrd_path": _STR}},
        "drives": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["drive_id", "is_root_device"],
            "properties": {"drive_id": _STR, "path_on_host": _STR, "is_root_device": {"type": "boolean"},
                           "is_read_only": {"type": "boolean"}, "partuuid": _STR,
                           "cache_type": {"enum": ["Unsafe", "Writeback"]}, "io_engine": {"enum": ["Sync", "Async"]}}}},
        "machine-config": {"type": "object", "additionalProperties": False,
                           "required": ["vcpu_count", "mem_size_mib"],
                           "properties": {"vcpu_count": {"type": "integer", "minimum": 1, "maximum": 32},
                                          "mem_size_mib": {"type": "integer", "minimum": 1},
                                          "smt": {"type": "boolean"}, "track_dirty_pages": {"type": "boolean"}}},
        "network-interfaces": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["iface_id", "host_dev_name"],
            "properties": {"iface_id": _STR, "host_dev_name": _STR,
                           "guest_mac": {"type": "string", "pattern": "^([0-9a-f]{2}:){5}[0-9a-f]{2}$"}}}},
    },
}


def test_vm_config_matches_the_schema_and_the_policy(tmp_path):
    out = tmp_path / "fc"
    res = cli("runtime", "render", "firecracker", "--policies", str(POLICIES), "--policy", "invoice-analysis",
              "--workspace-image", "/srv/ws.ext4", "--out", str(out))
    assert res.returncode == 0, res.stderr
    config = json.loads((out / "vm.json").read_text())
    jsonschema.validate(config, FC_SCHEMA)
    # invoice-analysis: cpu_millis 1500 -> 2 vCPUs (rounded up), memory_mb 2048, read-only root
    assert config["machine-config"] == {"vcpu_count": 2, "mem_size_mib": 2048, "smt": False}
    root, workspace = config["drives"]
    assert root["is_root_device"] and root["is_read_only"]
    assert workspace == {"drive_id": "workspace", "path_on_host": "/srv/ws.ext4", "is_root_device": False,
                         "is_read_only": False}
    (nic,) = config["network-interfaces"]
    assert nic["host_dev_name"] == "egfc-invoiceana"
    assert "ip=198.18.128.2::198.18.128.1:255.255.255.252:" in config["boot-source"]["boot_args"]
    with pytest.raises(jsonschema.ValidationError):  # positive control: the schema refuses a typo
        jsonschema.validate({**config, "machine-config": {"vcpus": 2, "mem_size_mib": 1}}, FC_SCHEMA)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tap": "this-name-is-too-long"}, "is not an interface name"),
    ({"tap": 'x";drop'}, "is not an interface name"),
    ({"subnet": "198.18.128.0/31"}, "/30 or larger"),
    ({"transparent": "localhost:8082"}, "--gateway-transparent must be IPV4:PORT"),
    ({"dns": "127.0.0.1:0"}, "--gateway-dns must be IPV4:PORT"),
    ({"kernel": "vmlinux"}, "--kernel must be an absolute path"),
])
def test_bad_inputs_are_refused(kwargs, message):
    ctx = load_context(POLICIES, "invoice-analysis")
    with pytest.raises(RenderError, match=message.replace("/", ".")):
        render_firecracker(ctx, **kwargs)


def test_too_many_vcpus_is_refused(tmp_path):
    text = (POLICIES / "seed-invoice-analysis.yaml").read_text().replace("cpu_millis: 1500", "cpu_millis: 64000")
    (tmp_path / "p.yaml").write_text(text)
    res = cli("runtime", "render", "firecracker", "--policies", str(tmp_path / "p.yaml"), "--policy",
              "invoice-analysis")
    assert res.returncode == 2 and "Firecracker allows at most 32" in res.stderr


# --- the nftables script, applied for real --------------------------------------------------------


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def tap_world():
    """Two throwaway namespaces: `host` (the gateway's listeners on 127.0.0.1, a canary on a public-looking
    address it owns, ip_forward on) and `vm`, joined by a veth whose host end has the tap's name."""
    tag = f"{os.getpid() % 100000}"
    host, vm, tap = f"egR-fch{tag}", f"egR-fcv{tag}", f"egRfc{tag}"
    peers: list[subprocess.Popen[str]] = []
    try:
        for ns in (host, vm):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", tap, "netns", host, "type", "veth", "peer", "name", "eth0", "netns", vm)
        sh("ip", "-n", host, "addr", "add", "198.18.128.1/30", "dev", tap)
        sh("ip", "-n", vm, "addr", "add", "198.18.128.2/30", "dev", "eth0")
        sh("ip", "-n", host, "link", "set", tap, "up")
        sh("ip", "-n", vm, "link", "set", "eth0", "up")
        sh("ip", "-n", vm, "route", "add", "default", "via", "198.18.128.1")
        sh("ip", "-n", host, "addr", "add", "198.18.129.1/32", "dev", "lo")  # the canary's address
        sh("ip", "netns", "exec", host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh("ip", "netns", "exec", host, "sysctl", "-qw", f"net.ipv4.conf.{tap}.route_localnet=1")
        serve = ["tcp", "127.0.0.1", "8080", "PROXY", "tcp", "127.0.0.1", "8081", "ADMIN",
                 "tcp", "127.0.0.1", "8082", "TRANSPARENT", "udp", "127.0.0.1", "5353", "RESOLVER",
                 "tcp", "198.18.129.1", "80", "CANARY", "udp", "198.18.129.1", "443", "CANARY",
                 "udp", "198.18.129.1", "53", "CANARY"]
        proc = subprocess.Popen(["ip", "netns", "exec", host, sys.executable, PEER, "serve", *serve],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        peers.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        yield host, vm, tap
    finally:
        for proc in peers:
            proc.stdin.close()
            proc.kill()
            proc.wait()
        for ns in (host, vm):
            sh("ip", "netns", "del", ns, check=False)


def ask(vm: str, kind: str, host: str, port: int) -> str:
    return sh("ip", "netns", "exec", vm, sys.executable, PEER, "ask", kind, host, str(port)).stdout.strip()


@pytest.mark.netns
def test_tap_rules_leave_only_the_gateway(tap_world, tmp_path):
    host, vm, tap = tap_world
    # positive control: without the rules the "VM" reaches the canary directly (TCP and QUIC-like UDP)
    assert ask(vm, "tcp", "198.18.129.1", 80) == "CANARY"
    assert ask(vm, "udp", "198.18.129.1", 443) == "CANARY"

    files = render_firecracker(load_context(POLICIES, "invoice-analysis"), tap=tap)
    script = tmp_path / "tap.nft"
    script.write_text(files["tap.nft"])
    checked = sh("ip", "netns", "exec", host, "nft", "-c", "-f", str(script), check=False)
    assert checked.returncode == 0, checked.stderr
    sh("ip", "netns", "exec", host, "nft", "-f", str(script))
    sh("ip", "netns", "exec", host, "nft", "-f", str(script))  # idempotent: re-applying replaces the table

    assert ask(vm, "tcp", "198.18.129.1", 80) == "TRANSPARENT"  # every TCP goes to the transparent listener
    assert ask(vm, "tcp", "198.18.128.1", 8080) == "PROXY"  # the explicit proxy at the host end
    assert ask(vm, "tcp", "198.18.128.1", 8081) == "TRANSPARENT"  # never the admin API
    assert ask(vm, "tcp", "127.0.0.1", 8081).startswith(("ERR", "TRANSPARENT"))  # not via its own loopback
    assert ask(vm, "udp", "198.18.129.1", 53) == "RESOLVER"  # DNS to ANY resolver is ours
    assert ask(vm, "udp", "198.18.129.1", 443).startswith("ERR")  # QUIC dropped
    ping = sh("ip", "netns", "exec", vm, "ping", "-c1", "-W1", "198.18.128.1", check=False)
    assert ping.returncode != 0  # ICMP dropped
    listed = sh("ip", "netns", "exec", host, "nft", "list", "tables").stdout
    assert listed.count(f"egressgate_fc_{tap}") == 1
