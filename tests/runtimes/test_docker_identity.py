"""Issue 20 item 4, docker and gVisor parity: two concurrent container sandboxes get different host uids
from runtime.uid_range; B does not see A's workspace or processes from inside (its own mounts and PID
namespace), and B's uid on the host cannot read A's mode-0600 workspace file. Positive control: A's uid reads
it, so the uid is what refuses. (The token bound to its address is the gateway's check, the same for every
runtime: tests/gateway/test_token_addresses.py, tests/runtimes/test_secrets_off_argv.py.)"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.runtimes.harness import Gateway, base_dir, remove, safety_net
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns
PY = "/usr/bin/python3"
A_CMD = 'umask 077; echo "$EGRESSGATE_SANDBOX_TOKEN" > /workspace/secret; id -u > /workspace/uid; exec sleep 60'
# B: is A's workspace (its host path) there, and whose processes can it see
B_CMD = (
    '[ -e "$1" ] && echo visible > /workspace/a || echo absent > /workspace/a; '
    "cat /proc/[0-9]*/status 2>/dev/null | grep ^Uid: | sort -u > /workspace/uids; id -u > /workspace/uid; "
    "exec sleep 60"
)
HOST_READ = "import sys\ntry:\n    print(open(sys.argv[1]).read().strip())\nexcept OSError as e:\n    print(e.strerror)"


def start(gateway: Gateway, dockerd: Dockerd, runtime: str, ws: Path, *command: str) -> subprocess.Popen[str]:
    argv = gateway.cmd(
        "sandbox",
        "run",
        "--config",
        str(gateway.config),
        "--policy",
        "rt-allow",
        "--workspace",
        str(ws),
        "--runtime",
        runtime,
        "--image",
        dockerd.busybox_image(),
        "--",
        *command,
    )
    return subprocess.Popen(
        argv,
        text=True,
        env={**gateway.caller_env(), "DOCKER_HOST": dockerd.host},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=safety_net,
    )


def wait_file(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().endswith("\n")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)
    return path.read_text()


def read_as(uid: int, path: Path) -> str:
    res = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", PY, "-c", HOST_READ, str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.mark.parametrize("runtime", ["docker", "gvisor"])
def test_concurrent_container_sandboxes_are_apart(gateway: Gateway, dockerd: Dockerd, runtime: str) -> None:
    ws_a, ws_b = base_dir("/var/tmp"), base_dir("/var/tmp")
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(start(gateway, dockerd, runtime, ws_a, "sh", "-c", A_CMD))
        uid_a = int(wait_file(ws_a / "uid", procs[0]))
        token = wait_file(ws_a / "secret", procs[0]).strip()
        procs.append(start(gateway, dockerd, runtime, ws_b, "sh", "-c", B_CMD, "sh", str(ws_a)))
        uid_b = int(wait_file(ws_b / "uid", procs[1]))
        first, last = gateway.uid_range
        assert first <= uid_a <= last and first <= uid_b <= last and uid_a != uid_b
        secret = ws_a / "secret"
        assert secret.stat().st_uid == uid_a and secret.stat().st_mode & 0o777 == 0o600
        # inside B: no trace of A's workspace, and only B's own processes
        assert wait_file(ws_b / "a", procs[1]).strip() == "absent"
        uids = {tuple(line.split()[1:]) for line in wait_file(ws_b / "uids", procs[1]).splitlines()}
        assert uids == {(str(uid_b),) * 4}, uids
        # on the host, B's uid cannot read A's file; positive control: A's uid can
        assert read_as(uid_b, secret) == "Permission denied"
        assert read_as(uid_a, secret) == token
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.communicate(timeout=60)
        remove(ws_a)
        remove(ws_b)
