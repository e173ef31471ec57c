"""Facts about the machine the tests run on: CI or not, free ports, whether network namespaces work."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator

IN_CI = os.environ.get("CI") == "true"


def free_port(host: str = "127.0.0.1", kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def refusing_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A TCP port that refuses connections for as long as the block runs.

    A port merely found free can be taken by the next listener (a gateway the test starts later took
    one in CI, and the "dead upstream" became the gateway's own listener). Holding it bound without
    listen() makes the kernel answer every SYN with a reset and keeps anyone else from binding it.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        yield s.getsockname()[1]


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
