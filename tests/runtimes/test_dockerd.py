"""The test dockerd itself: isolated from the real network, and gone without a trace after close()."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support.dockerd import Dockerd, running

pytestmark = pytest.mark.netns


def test_daemon_netns_has_no_route_but_its_bridge(dockerd: Dockerd) -> None:
    """Even a container on the bridge network can reach nothing real: the daemon's namespace has
    only lo and docker0 (198.18.250.0/24), no default route, so the kernel has nowhere to send it."""
    routes = subprocess.run(["ip", "-n", dockerd.netns, "route", "show", "table", "all"], capture_output=True,
                            text=True, check=True).stdout
    assert "default" not in routes, routes
    links = subprocess.run(["ip", "-n", dockerd.netns, "-o", "link"], capture_output=True, text=True,
                           check=True).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    assert names <= {"lo", "docker0"} | {n for n in names if n.startswith("veth")}, names
    img = dockerd.busybox_image()
    # positive control: the bridge itself works (the container reaches its gateway's address) ...
    out = dockerd.docker("run", "--rm", img, "sh", "-c", "ip route; ping -c1 -W1 198.18.250.1 >/dev/null && "
                         "echo GW_OK; ip route get 198.18.1.10 || echo NO_ROUTE", check=False)
    assert "default via 198.18.250.1" in out.stdout and "GW_OK" in out.stdout, out
    # ... and the daemon's namespace would drop anything beyond it (no route from there)
    probe = subprocess.run(["ip", "-n", dockerd.netns, "route", "get", "198.18.1.10"], capture_output=True,
                           text=True, check=False)
    assert probe.returncode != 0 and "unreachable" in probe.stderr, probe


def test_default_docker_subnet_never_used(dockerd: Dockerd) -> None:
    nets = dockerd.docker("network", "inspect", "bridge", "-f", "{{json .IPAM.Config}}").stdout
    assert "198.18.250.0/24" in nets and "172.17" not in nets, nets


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_close_leaves_nothing(runtime: str) -> None:
    """A daemon with a live (held) container is torn down completely: processes (shims, runsc sandbox
    and gofer), mounts, namespace, cgroups and files. A short state path of its own (not tmp_path, which
    is longer under xdist): containerd's debug socket under it must fit a Unix socket path (104 bytes)."""
    base = Path(tempfile.mkdtemp(prefix="egD-"))
    state = base / "d"
    with running(state) as d:
        img = d.busybox_image()
        d.docker("run", "-d", "--runtime", runtime, "--network", "none", img, "sleep", "600")
        pid_text = d.docker("ps", "-q").stdout.split()
        assert len(pid_text) == 1
        cpid = int(d.docker("inspect", "-f", "{{.State.Pid}}", pid_text[0]).stdout)
        assert Path(f"/proc/{cpid}").exists()
        netns, cgroup = d.netns, d.cgroup_parent
        # not `docker rm` first: close() must cope with running containers on its own
    assert not Path(f"/proc/{cpid}").exists()
    assert not state.exists()
    assert netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert str(state) not in Path("/proc/self/mountinfo").read_text()
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{cgroup}"))
    leaked = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()
              and str(state).encode() in _cmdline(p)]
    assert leaked == []
    base.rmdir()  # close() removed everything under it


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""
