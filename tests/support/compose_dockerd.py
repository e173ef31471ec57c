"""A minimal private dockerd inside a closed network namespace, for the docker-compose test.

Kept deliberately small until the shared dockerd fixture (h10-docker's tests/support/dockerd.py) lands;
the lead can replace `ClosedDockerd` with it (same idea: state in a temp dir, the daemon inside its own
namespace, `--iptables=false`, addresses only in 198.18.0.0/15).

Why a namespace of its own: the daemon's bridges and the containers behind them must have no route to
the real network. The namespace holds only `lo`, the bridges dockerd creates, and whatever addresses the
test adds (an upstream, a metadata canary), so nothing a container does can leave it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

DOCKER = "/usr/bin/docker"  # an older/newer CLI may be first on PATH
DOCKERD = "/usr/sbin/dockerd"
COMPOSE = "/usr/bin/docker-compose"
PREFIX = "egR"  # every host object this module creates starts with it
BIP = "198.18.251.1/24"
ADDRESS_POOL = "base=198.19.64.0/18,size=24"


def sh(*args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stdout[-2000:]} {res.stderr[-2000:]}")
    return res


class ClosedDockerd:
    """dockerd in namespace `egR<sid>-dk` (start with `start()`, always `close()`)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.sid = secrets.token_hex(3)
        self.netns = f"{PREFIX}{self.sid}-dk"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"unix://{self.state / 'docker.sock'}"

    def env(self) -> dict[str, str]:
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DOCKER_HOST": self.host,
                "DOCKER_CONFIG": str(self.state / "cli"), "HOME": str(self.state)}

    def start(self) -> ClosedDockerd:
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "cli").mkdir(exist_ok=True)
        sh("ip", "netns", "add", self.netns)
        sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        log = open(self.state / "dockerd.log", "wb")  # noqa: SIM115 - the daemon keeps it open
        # nsenter --net, not `ip netns exec`: that one remounts /sys and hides the cgroup hierarchies
        self.proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns}", DOCKERD, "--host", self.host,
             "--data-root", str(self.state / "data"), "--exec-root", str(self.state / "exec"),
             "--pidfile", str(self.state / "docker.pid"), "--iptables=false", "--ip-forward=false",
             "--ip-masq=false", "--storage-driver=overlay2", "--bip", BIP, "--default-address-pool", ADDRESS_POOL,
             "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env())
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            if (self.state / "docker.sock").exists() and self.docker("version", check=False).returncode == 0:
                return self
            time.sleep(0.1)
        raise RuntimeError("dockerd did not start: " + (self.state / "dockerd.log").read_text(errors="replace")[-3000:])

    def docker(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return sh(DOCKER, *args, check=check, timeout=timeout, env=self.env())

    def in_netns(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return sh("ip", "netns", "exec", self.netns, *args, check=check, timeout=timeout)

    def close(self) -> None:
        """Remove the containers, stop the daemon, then kill by PID whatever still names our state dir
        (containerd, shims), unmount what it left, delete the namespace (its bridges go with it)."""
        if self.proc is not None and self.proc.poll() is None:
            ids = self.docker("ps", "-aq", check=False).stdout.split()
            if ids:
                self.docker("rm", "-f", *ids, check=False)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        needle = str(self.state).encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if needle in (entry / "cmdline").read_bytes():
                        os.kill(int(entry.name), signal.SIGKILL)
        with contextlib.suppress(OSError):
            targets = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
            for target in sorted((t for t in targets if t.startswith(str(self.state))), key=len, reverse=True):
                subprocess.run(["umount", "-l", target], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        shutil.rmtree(self.state, ignore_errors=True)
