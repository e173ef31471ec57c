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
