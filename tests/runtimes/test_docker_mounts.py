"""Issue 20 parity for docker and gVisor: the workspace and the read-write allowed host paths reach the
container as `nosuid,nodev` mounts (Docker's binds take no such option: `sandbox run` hands over
nosuid,nodev binds of its own, diskfs.nosuid_bind, and the container's read-write bind inherits their
flags), and /tmp is the run's own (owned by the run's uid/gid like the netns runtime's, not root's 1777
shared by every uid). Nothing of the binds is left after the run.

Positive controls: the same workspace bound by Docker without that step (the adapter alone) is neither
nosuid nor nodev inside runc, and Docker's tmpfs /tmp without the uid/gid options is root's."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes.diskfs import mounts
from tests.networld import World
from tests.runtimes.docker_support import make_spec, run
from tests.runtimes.harness import Gateway, base_dir, remove, running_gateway, runtime_policy, sandbox_id
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns
RUNTIMES = ["docker", "gvisor"]
REPORT = (
    "grep ' /workspace ' /proc/self/mountinfo > /workspace/mountinfo; "
    'grep " $RW " /proc/self/mountinfo > /workspace/rwinfo; touch "$RW/written"; '
    "stat -c '%u %g %a' /tmp > /workspace/tmp; id -u > /workspace/uid; touch /tmp/x && echo ok > /workspace/w; "
    "while [ ! -e /workspace/go ]; do sleep 0.05; done"
)


def mount_options(line: str) -> set[str]:
    """The per-mount and super-block options of one mountinfo line."""
    left, _, right = line.partition(" - ")
    return set(left.split()[5].split(",")) | set(right.split()[2].split(","))


@pytest.fixture(scope="module")
def rw_tree() -> Iterator[Path]:
    """A host directory a policy allows read-write."""
    path = base_dir("/var/tmp")
    path.chmod(0o777)
    try:
        yield path
    finally:
        remove(path)


@pytest.fixture(scope="module")
def mgw(world: World, rw_tree: Path) -> Iterator[Gateway]:
    policies = {
        "dm-rw": runtime_policy("dm-rw", filesystem__allow=[{"path": str(rw_tree), "read": True, "write": True}])
    }
    with running_gateway(world, policies) as gw:
        yield gw


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_workspace_nosuid_nodev_and_tmp_owned_by_the_run(
    mgw: Gateway, dockerd: Dockerd, rw_tree: Path, runtime: str
) -> None:
    """The workspace and the read-write allowed tree are bound from nosuid,nodev mounts; /tmp is the run's."""
    gateway = mgw
    ws = base_dir("/var/tmp")
    try:
        argv = gateway.cmd(
            "sandbox",
            "run",
            "--config",
            str(gateway.config),
            "--policy",
            "dm-rw",
            "--workspace",
            str(ws),
            "--runtime",
            runtime,
            "--image",
            dockerd.busybox_image(),
            "--",
            "sh",
            "-c",
            f"RW={rw_tree}; {REPORT}",
        )
        proc = subprocess.Popen(
            argv,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**gateway.caller_env(), "DOCKER_HOST": dockerd.host},
        )
        deadline = time.monotonic() + 120
        while not (ws / "w").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        # during the run: the mount Docker bound is `sandbox run`'s nosuid,nodev bind of the workspace
        binds = [p for p, _fs, _src in mounts() if Path(p).parent.parent == gateway.state_dir / "binds"]
        assert len(binds) == 2, binds  # the workspace and the read-write allowed tree
        with open("/proc/self/mountinfo") as fh:
            lines = [x for x in fh if x.split()[4] in binds]
        assert len(lines) == 2 and all({"nosuid", "nodev"} <= mount_options(x) for x in lines), lines
        uid = int((ws / "uid").read_text())
        (ws / "go").touch()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert sandbox_id(err)
        first, last = gateway.uid_range
        assert first <= uid <= last
        assert (ws / "tmp").read_text().split() == [str(uid), str(uid), "1777"]  # the run's own /tmp
        assert (rw_tree / "written").exists()  # the allowed tree is the host's, read-write
        if runtime == "docker":  # runc shows the host's mount flags; gVisor's /proc shows its own view
            for name in ("mountinfo", "rwinfo"):
                assert {"nosuid", "nodev"} <= mount_options((ws / name).read_text()), (ws / name).read_text()
        # nothing of the bind is left: no mount, no directory
        assert not [p for p, _fs, _src in mounts() if "/binds/" in p and p.startswith(str(gateway.state_dir))]
        assert not list((gateway.state_dir / "binds").glob("*"))
    finally:
        remove(ws)


def test_controls_docker_alone_binds_suid_and_gives_root_tmp(dockerd: Dockerd, tmp_path: Path) -> None:
    """Positive controls (runc shows the bound mount's flags in the container): the adapter alone binds the
    plain workspace directory, which is neither nosuid nor nodev inside; Docker's /tmp tmpfs without the
    uid/gid options is root's."""
    spec = make_spec(tmp_path, dockerd.busybox_image(), ["sh", "-c", "RW=/nonexistent; " + REPORT.split("; while")[0]])
    info = run(dockerd, "docker", spec)
    assert info.exit_code() == 0, info
    opts = mount_options((tmp_path / "ws" / "mountinfo").read_text())
    assert "nosuid" not in opts and "nodev" not in opts, opts
    res = dockerd.docker(
        "run",
        "--rm",
        "--network",
        "none",
        "--tmpfs",
        "/tmp:rw,mode=1777",
        dockerd.busybox_image(),
        "stat",
        "-c",
        "%u %g %a",
        "/tmp",
    )
    assert res.stdout.split() == ["0", "0", "1777"], res
