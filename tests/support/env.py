"""Facts about the machine the tests run on: CI or not, free ports, whether network namespaces work."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

IN_CI = os.environ.get("CI") == "true"


def free_port(host: str = "127.0.0.1", kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def netns_unavailable_reason() -> str | None:
    """Why network-namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None or shutil.which("nft") is None:
        return "needs iproute2 and nftables (make test installs them as root)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"ip netns unavailable: {probe.stderr.strip()}"
    return None
