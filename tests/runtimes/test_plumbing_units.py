"""The pure parts of the plumbing: the nftables text (checked by the kernel's own parser with `nft -c`
in a throwaway network namespace), DNAT targets, address slots under concurrency, the runtime file."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest

from egressgate.runtimes import addressing, endpoints, nftables, records
from egressgate.runtimes.base import GatewayEndpoints, SandboxAddress

ADDR = SandboxAddress(host_ip="198.18.128.1", sandbox_ip="198.18.128.2", prefix_len=30,
                      host_if="egh0123456789", sandbox_if="egs0123456789")
GW = GatewayEndpoints(proxy=("127.0.0.1", 8080), transparent=("127.0.0.1", 8082), dns=("127.0.0.1", 5353),
                      admin=("127.0.0.1", 8081))


def nft_check(ruleset: str) -> subprocess.CompletedProcess[str]:
    """The kernel parses the ruleset (`nft -c`: nothing is committed) in a fresh, empty netns."""
    return subprocess.run(["unshare", "--net", "nft", "-c", "-f", "-"], input=ruleset, capture_output=True,
                          text=True, check=False, timeout=30)


# one line per rule the module docstring promises (the escape tests prove each one's effect)
HOST_RULES = [
    'iifname "egh0123456789" meta nfproto != ipv4 counter name "drop_ipv6" drop',
    'iifname "egh0123456789" ip saddr != 198.18.128.2 counter name "drop_spoofed" drop',
    'iifname "egh0123456789" meta l4proto != { tcp, udp } counter name "drop_not_tcp_udp" drop',
    'iifname "egh0123456789" udp dport != 53 counter name "drop_udp" drop',
    'iifname "egh0123456789" ip daddr 198.18.128.1 tcp dport 8080 dnat ip to 127.0.0.1:8080',
    'iifname "egh0123456789" meta l4proto { tcp, udp } th dport 53 dnat ip to 127.0.0.1:5353',
    'iifname "egh0123456789" meta l4proto tcp dnat ip to 127.0.0.1:8082',
    'iifname "egh0123456789" ct status dnat ip daddr . meta l4proto . th dport { 127.0.0.1 . tcp . 8080, '
    '127.0.0.1 . tcp . 5353, 127.0.0.1 . udp . 5353, 127.0.0.1 . tcp . 8082 } accept',
    'oifname "egh0123456789" drop',
]


@pytest.mark.netns  # `unshare --net` + nft: root
def test_host_ruleset_has_every_rule_and_the_kernel_accepts_it() -> None:
    text = nftables.host_ruleset("0123456789", ADDR, GW)
    for rule in HOST_RULES:
        assert rule in text, rule
    assert text.startswith("table inet egressgate_0123456789 {")
    res = nft_check(text)
    assert res.returncode == 0, res.stderr


@pytest.mark.netns  # `unshare --net` + nft: root
def test_without_a_transparent_listener_other_tcp_is_not_dnated_but_refused() -> None:
    gw = GatewayEndpoints(proxy=GW.proxy, transparent=None, dns=GW.dns, admin=GW.admin)
    text = nftables.host_ruleset("0123456789", ADDR, gw)
    assert "8082" not in text and "dnat ip to 127.0.0.1:8080" in text
    assert 'meta l4proto tcp counter name "drop_tcp" reject with tcp reset' in text
    assert nft_check(text).returncode == 0


@pytest.mark.netns  # `unshare --net` + nft: root
def test_sandbox_ruleset_is_accepted_and_drops_by_default() -> None:
    text = nftables.sandbox_ruleset(ADDR)
    assert "policy drop;" in text and 'oifname "egs0123456789" udp dport 53 accept' in text
    res = nft_check(text)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(("listener", "expected"), [
    (("127.0.0.1", 8080), ("127.0.0.1", 8080)),
    (("0.0.0.0", 8080), ("127.0.0.1", 8080)),
    (("::", 8080), ("127.0.0.1", 8080)),
    (("198.18.0.1", 9), ("198.18.0.1", 9)),
])
def test_dnat_target(listener: tuple[str, int], expected: tuple[str, int]) -> None:
    assert nftables.dnat_target(listener, "proxy") == expected


def test_dnat_to_an_ipv6_listener_is_a_setup_error() -> None:
    with pytest.raises(ValueError, match="IPv6"):
        nftables.dnat_target(("::1", 8080), "proxy")


def test_only_our_tables_are_ever_deleted() -> None:
    with pytest.raises(ValueError, match="not ours"):
        nftables.delete_table("filter")


def _allocate(state_dir: str, run_id: str, out: multiprocessing.Queue) -> None:
    address = addressing.allocate(Path(state_dir), "198.18.128.0/27", run_id, {"owner_pid": os.getpid()})
    out.put((run_id, address.host_ip, address.sandbox_ip))


def test_parallel_allocations_get_distinct_slots_then_the_pool_is_exhausted(tmp_path: Path) -> None:
    out: multiprocessing.Queue = multiprocessing.Queue()
    ids = [records.new_run_id() for _ in range(8)]  # a /27 holds exactly 8 slots
    procs = [multiprocessing.Process(target=_allocate, args=(str(tmp_path), i, out)) for i in ids]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    got = [out.get(timeout=5) for _ in ids]
    assert len({g[1] for g in got}) == 8 and len({g[2] for g in got}) == 8
    for _, host, sandbox in got:
        assert int(sandbox.split(".")[-1]) == int(host.split(".")[-1]) + 1
    with pytest.raises(addressing.AddressesExhausted, match="sandbox gc"):
        addressing.allocate(tmp_path, "198.18.128.0/27", records.new_run_id(), {})
    records.remove(tmp_path, ids[3])  # a freed slot is reused
    again = addressing.allocate(tmp_path, "198.18.128.0/27", records.new_run_id(), {})
    assert again.host_ip == next(g[1] for g in got if g[0] == ids[3])


def _runtime_file(var: Path, **changes: object) -> None:
    data = {"proxy": "127.0.0.1:8080", "admin": "127.0.0.1:8081", "dns": "127.0.0.1:5353",
            "transparent": "127.0.0.1:8082", "pid": os.getpid(),
            "runtime": {"subnet": "198.18.128.0/17", "state_dir": "/run/egressgate", "uid_range": "65536-99999"},
            "admin_token_file": str(var / "admin.token"), "audit_file": str(var / "audit.jsonl")}
    data.update(changes)
    (var / "gateway.json").write_text(json.dumps(data))


def test_runtime_file(tmp_path: Path) -> None:
    with pytest.raises(endpoints.GatewayNotRunning, match="does not exist"):
        endpoints.load(tmp_path)
    _runtime_file(tmp_path)
    info = endpoints.load(tmp_path)
    assert info.endpoints.transparent == ("127.0.0.1", 8082) and info.subnet == "198.18.128.0/17"
    _runtime_file(tmp_path, transparent=None)
    assert endpoints.load(tmp_path).endpoints.transparent is None
    _runtime_file(tmp_path, dns=None)
    with pytest.raises(endpoints.GatewayNotRunning, match=r"listen\.dns"):
        endpoints.load(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    _runtime_file(tmp_path, pid=dead.pid)
    with pytest.raises(endpoints.GatewayNotRunning, match="not running"):
        endpoints.load(tmp_path)
    _runtime_file(tmp_path, runtime=None)
    with pytest.raises(endpoints.GatewayNotRunning, match=r"older gateway\?"):
        endpoints.load(tmp_path)


@pytest.mark.parametrize("path", ["/", "/etc", "/etc/../etc", "/usr/", "/var/tmp", "/tmp/.."])
def test_a_system_directory_is_never_a_workspace(path: str) -> None:
    """Checked before prepare_workspace changes any ownership (tested on the pure check: an end-to-end
    test would chown the host's /etc if the check ever regressed)."""
    from egressgate.runtimes.workload import SetupFailed, check_workspace

    with pytest.raises(SetupFailed, match="system directory"):
        check_workspace(Path(path))


def test_a_directory_of_its_own_is_a_workspace(tmp_path: Path) -> None:
    from egressgate.runtimes.workload import check_workspace

    check_workspace(tmp_path / "ws")  # no exception


def test_the_seccomp_filter_exists_for_known_arches_only() -> None:
    """Fail closed: on an architecture with no filter the netns runtime refuses to start (the escape
    test proves the x86_64 filter's effect)."""
    from egressgate.runtimes.seccomp import NO_NR, SETID_MODE, SeccompUnavailable, no_unix_sockets

    # same shape, other numbers; aarch64 lacks the legacy set-id calls (chmod, open, creat, mknod): 3
    # instructions (match, load the mode, test its bits) of 8 bytes each fewer per missing call
    missing = sum(1 for m in SETID_MODE if m.nr[1] == NO_NR)
    assert len(no_unix_sockets("x86_64")) == len(no_unix_sockets("aarch64")) + missing * 3 * 8
    with pytest.raises(SeccompUnavailable, match="riscv64"):
        no_unix_sockets("riscv64")
