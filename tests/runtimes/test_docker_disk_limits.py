"""Docker and gVisor parity for the kernel-bounded workspace and /tmp (diskfs.py): the temporary workspace is
the host tmpfs `sandbox run` mounts (bind-mounted into the container), a persistent one the loop-mounted ext4
image, and /tmp the container's own tmpfs with `size=`/`nr_inodes=` (sandbox.tmp.max_bytes). Writes past the
limit get ENOSPC inside; a full workspace ends the run with 123; nothing of the run stays mounted."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes.diskfs import IMAGE, loops_of, mounts
from tests.networld import World
from tests.runtimes.batch import batch, split
from tests.runtimes.harness import KEPT_WORKSPACE, Gateway, base_dir, remove, running_gateway, runtime_policy
from tests.runtimes.runs import loops_freed
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns
MiB = 1024 * 1024
RUNTIMES = ["docker", "gvisor"]

# writes `n` MiB to `path` in 64 KiB steps; prints how many bytes the kernel took and the error if any
WRITE = """
import errno, sys
path, n = sys.argv[1], int(sys.argv[2])
done = 0
try:
    with open(path, "wb") as f:
        for _ in range(n * 16):
            f.write(b"\\0" * 65536); f.flush(); done += 65536
except OSError as e:
    print("error", errno.errorcode[e.errno])
print("wrote", done)
"""


@pytest.fixture(scope="module")
def gateway(world: World, host_files: Path) -> Iterator[Gateway]:
    policies = {
        "dd-ws": runtime_policy("dd-ws", sandbox__workspace={**KEPT_WORKSPACE, "max_bytes": 2 * MiB},
                                sandbox__tmp={"max_bytes": 4 * MiB}),
    }
    with running_gateway(world, policies) as gw:
        yield gw


def run_in(gateway: Gateway, dockerd: Dockerd, runtime: str, *command: str,
           workspace: Path | None = None) -> subprocess.CompletedProcess[str]:
    extra = ["--workspace", str(workspace)] if workspace else []
    argv = gateway.cmd("sandbox", "run", "--config", str(gateway.config), "--policy", "dd-ws", *extra,
                       "--runtime", runtime, "--image", dockerd.python_image(), "--", *command)
    env = {**gateway.caller_env(), "DOCKER_HOST": dockerd.host}
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, check=False)


def wrote(out: str) -> int:
    return int(out.split("wrote")[1].split()[0])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_tmp_is_bounded_and_under_the_limit_fits(gateway: Gateway, dockerd: Dockerd, runtime: str) -> None:
    """One run (tests/runtimes/batch.py): 16 MiB into /tmp stops at the 4 MiB bound; once that file is gone,
    3 MiB fits."""
    programs = {"big": ["python3", "-c", WRITE, "/tmp/big", "16"], "clear": ["rm", "/tmp/big"],
                "small": ["python3", "-c", WRITE, "/tmp/small", "3"]}
    res = run_in(gateway, dockerd, runtime, *batch(programs))
    assert res.returncode == 0, res.stdout + res.stderr
    ran = split(list(programs), res.stdout, res.stderr)
    big, clear, ok = ran["big"], ran["clear"], ran["small"]
    assert "error ENOSPC" in big.stdout and wrote(big.stdout) <= 4 * MiB, (big, res.stderr)
    assert clear.returncode == 0, clear
    assert ok.returncode == 0 and wrote(ok.stdout) == 3 * MiB, (ok, res.stderr)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_temporary_workspace_full_gets_enospc_and_123(gateway: Gateway, dockerd: Dockerd, runtime: str) -> None:
    res = run_in(gateway, dockerd, runtime, "sh", "-c", "python3 -c \"$0\" /workspace/big 16; sleep 5", WRITE)
    assert "error ENOSPC" in res.stdout and wrote(res.stdout) <= 2 * MiB, res.stdout + res.stderr
    assert res.returncode == 123, res.stderr  # the sleep is cut short: the full workspace ended the run
    assert not any(p.startswith(str(gateway.state_dir)) for p, _, _ in mounts())


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_persistent_workspace_image(gateway: Gateway, dockerd: Dockerd, runtime: str) -> None:
    ws = base_dir()
    try:
        first = run_in(gateway, dockerd, runtime, "python3", "-c", WRITE, "/workspace/a", "1", workspace=ws)
        assert first.returncode == 0 and wrote(first.stdout) == MiB, first.stdout + first.stderr
        again = run_in(gateway, dockerd, runtime, "python3", "-c", WRITE, "/workspace/b", "16", workspace=ws)
        assert again.returncode == 123, again.stdout + again.stderr  # killed when full (before it prints)
        assert (ws / IMAGE).stat().st_size == 2 * MiB
        # the container's mount namespace (runc's, or gVisor's gofer) lets go of the file system a moment
        # after the container is removed; the loop device (autoclear) goes with it
        deadline = time.monotonic() + 20
        while loops_of(ws / IMAGE) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert loops_freed(ws / IMAGE) == [] and not any(p == str(ws) for p, _, _ in mounts())
    finally:
        remove(ws)
