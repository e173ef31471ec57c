"""Hostile code for the runtime escape tests: the checks probe.py runs inside a sandbox, how hostile code
starts it (no proxy settings, NO_PROXY=*), and how its answer is read (shared by the netns and docker
escape tests)."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import tests.networld as nw

PROBE = (Path(__file__).with_name("probe.py")).read_text()
PY = "/usr/bin/python3"


def leak_name() -> str:
    return f"leak-{secrets.token_hex(4)}.evil.test"


def network_checks(leak: str, leak_tcp: str) -> list[list]:
    return [
        ["tcp", "169.254.169.254", 80, "GET / HTTP/1.0\r\nHost: 169.254.169.254\r\n\r\n"],  # 0 metadata
        ["tcp", "10.0.0.5", 80, "GET / HTTP/1.0\r\nHost: 10.0.0.5\r\n\r\n"],  # 1 private IP
        ["tcp", "fd00:ec2::254", 80, "GET / HTTP/1.0\r\n\r\n"],  # 2 IPv6 literal
        ["dns", nw.DNS_ADDR, leak, "udp"],  # 3 "public" resolver, UDP 53
        ["tls", nw.DNS_ADDR, 853, "dns.public.test"],  # 4 DNS over TLS
        ["udp", nw.UPSTREAM, 443],  # 5 QUIC
        ["icmp", nw.UPSTREAM],  # 6 ICMP echo (unprivileged ICMP socket)
        ["raw", 1],  # 7 raw ICMP socket
        ["raw", 6],  # 8 raw TCP socket
        ["tls", "10.0.0.5", 443, "api.allowed.test"],  # 9 an allowed name "pinned" to a private IP (edited hosts)
        ["dns", nw.DNS_ADDR, leak_tcp, "tcp"],  # 10 "public" resolver, TCP 53
    ]


def probe_argv(checks: list[list], hostile: bool = True) -> list[str]:
    """The probe as hostile code runs it: no proxy settings at all, NO_PROXY=* for good measure
    (hostile=False: in the environment the sandbox was given)."""
    if not hostile:
        return [PY, "-c", PROBE, json.dumps(checks)]
    return ["env", "-u", "HTTP_PROXY", "-u", "HTTPS_PROXY", "-u", "http_proxy", "-u", "https_proxy", "NO_PROXY=*",
            PY, "-c", PROBE, json.dumps(checks)]


def parse(stdout: str) -> list[dict]:
    return json.loads(stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the kernel surface (issue 20)
AF_PACKET, AF_ALG, AF_TIPC, AF_NETLINK = 17, 38, 30, 16
NETLINK_ROUTE, NETLINK_AUDIT, NETLINK_KOBJECT_UEVENT = 0, 9, 15
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_RDM, SOCK_SEQPACKET = 1, 2, 3, 4, 5
UFFD_USER_MODE_ONLY_CLOEXEC = 1 | 0o2000000
NO_PID = 0x7FFFFFFF  # no such process: the kernel answers ESRCH where seccomp lets the call through


def syscall_numbers() -> dict[str, int]:
    """This machine's numbers of the refused syscalls (the table the filter is compiled from)."""
    import platform

    from egressgate.runtimes.seccomp import ARCH_INDEX, REFUSED

    i = ARCH_INDEX[platform.machine()]
    return {s.name: s.nr[i] for s in REFUSED}


# name → probe check. Each refused syscall is called with arguments the kernel itself rejects with an
# error other than EPERM (EFAULT, EINVAL, ESRCH) or accepts: EPERM can only come from the filter.
def kernel_checks(vsock_port: int) -> dict[str, list]:
    nr = syscall_numbers()
    return {
        "vsock": ["vsock", vsock_port],
        "packet": ["family", AF_PACKET, SOCK_DGRAM, 0],
        "alg": ["family", AF_ALG, SOCK_SEQPACKET, 0],
        "tipc": ["family", AF_TIPC, SOCK_RDM, 0],
        "netlink_audit": ["family", AF_NETLINK, SOCK_RAW, NETLINK_AUDIT],
        "netlink_uevent": ["family", AF_NETLINK, SOCK_RAW, NETLINK_KOBJECT_UEVENT],
        "inet": ["family", 2, SOCK_STREAM, 0],
        "inet6": ["family", 10, SOCK_DGRAM, 0],
        "netlink_route": ["family", AF_NETLINK, SOCK_RAW, NETLINK_ROUTE],
        "pair_stream": ["pairfam", 1, SOCK_STREAM],
        "pair_dgram": ["pairfam", 1, SOCK_DGRAM],
        "resolve": ["resolve", "api.allowed.test"],
        "io_uring_setup": ["sys", nr["io_uring_setup"], 1, 0],  # NULL params: EFAULT
        "bpf": ["sys", nr["bpf"], 9999, 0, 0],  # no such command: EINVAL (root)
        "userfaultfd": ["sys", nr["userfaultfd"], UFFD_USER_MODE_ONLY_CLOEXEC],  # allowed unprivileged
        "perf_event_open": ["sys", nr["perf_event_open"], 0, 0, -1, -1, 0],  # NULL attr: EFAULT
        "keyctl": ["sys", nr["keyctl"], 0, -3, 0],  # KEYCTL_GET_KEYRING_ID(session)
        "ptrace": ["sys", nr["ptrace"], 16, NO_PID, 0, 0],  # PTRACE_ATTACH: ESRCH
        "process_vm_readv": ["sys", nr["process_vm_readv"], NO_PID, 0, 1, 0, 1, 0],  # ESRCH
    }


def run_named(checks: dict[str, list], stdout: str) -> dict[str, dict]:
    return dict(zip(checks, parse(stdout), strict=True))


REFUSED_FAMILIES = ("packet", "alg", "tipc", "netlink_audit", "netlink_uevent")
ALLOWED = ("inet", "inet6", "netlink_route", "pair_stream", "pair_dgram")
REFUSED_SYSCALLS = ("io_uring_setup", "bpf", "userfaultfd", "perf_event_open", "keyctl", "ptrace",
                    "process_vm_readv")
