"""`sandbox run` with kernel-bounded workspace and /tmp (diskfs.py), real gateway, real bwrap: ENOSPC at the
limit, exit 123 when the workspace fills (kill-on-exceed as before), a persistent workspace across two runs,
/tmp bounded, and no mount or loop device of the run left after a normal run or after SIGKILL + gc.
Only this module's own run ids and paths are checked (other tests run in parallel)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes.diskfs import IMAGE, loops_of, mounts
from tests.networld import World
from tests.runtimes.harness import Gateway, base_dir, remove, running_gateway, runtime_policy, sandbox_id

pytestmark = pytest.mark.netns
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def gateway(world: World, host_files: Path) -> Iterator[Gateway]:
    policies = {
        "dl-ws": runtime_policy("dl-ws", sandbox__workspace={"path": "/workspace", "max_bytes": 2 * MiB}),
        "dl-ws8": runtime_policy("dl-ws8", sandbox__workspace={"path": "/workspace", "max_bytes": 8 * MiB}),
        "dl-tmp": runtime_policy("dl-tmp", sandbox__tmp={"max_bytes": 4 * MiB}),
        "dl-open": runtime_policy("dl-open"),
    }
    with running_gateway(world, policies) as gw:
        yield gw


def test_fallocate_in_a_temporary_workspace_gets_enospc(gateway: Gateway) -> None:
    script = ": > f; fallocate -n -l 64M f && echo allocated; du -k f"
    res = gateway.run("sh", "-c", script, policy="dl-ws", timeout=60)
    assert "allocated" not in res.stdout and "No space left" in res.stderr, res.stdout + res.stderr
    # tmpfs undoes a failed fallocate: nothing is held, the workspace is not full, the run goes on
    assert int(res.stdout.split()[0]) <= 2 * 1024 and res.returncode == 0
    # positive control: the same call without max_bytes succeeds (64 MiB really allocated)
    ok = gateway.run("sh", "-c", script.replace("du -k f", "du -k f; rm f"), policy="dl-open", timeout=60)
    assert ok.returncode == 0 and "allocated" in ok.stdout and int(ok.stdout.split()[-2]) >= 64 * 1024, ok


def test_writing_under_the_limit_succeeds(gateway: Gateway) -> None:
    res = gateway.run("sh", "-c", f"head -c {MiB + MiB // 2} /dev/zero > f && echo fit", policy="dl-ws")
    assert res.returncode == 0 and "fit" in res.stdout, res.stdout + res.stderr


def test_unlinked_open_file_fills_and_ends_the_run(gateway: Gateway) -> None:
    script = "exec 3>held; rm held; head -c 4194304 /dev/zero >&3; echo survived; sleep 5"
    begin = time.monotonic()
    res = gateway.run("sh", "-c", script, policy="dl-ws", timeout=60)
    assert res.returncode == 123 and time.monotonic() - begin < 5, res.stdout + res.stderr


def test_tmp_is_bounded(gateway: Gateway) -> None:
    script = "head -c 8388608 /dev/zero > /tmp/big; du -k /tmp/big"
    res = gateway.run("sh", "-c", script, policy="dl-tmp")
    assert "No space left" in res.stderr and int(res.stdout.split()[0]) <= 4 * 1024, res.stdout + res.stderr
    ok = gateway.run("sh", "-c", script, policy="dl-open")  # default 256 MiB: 8 MiB fits
    assert ok.returncode == 0 and int(ok.stdout.split()[0]) >= 8 * 1024, ok.stdout + ok.stderr


def test_persistent_workspace_keeps_content_and_limit_across_runs(gateway: Gateway) -> None:
    ws = base_dir()
    (ws / "input.txt").write_text("operator data\n")
    try:
        first = gateway.run("sh", "-c", "cat input.txt; echo from-run-1 > out.txt", policy="dl-ws8", workspace=ws)
        assert first.returncode == 0 and "operator data" in first.stdout, first.stderr
        assert sorted(os.listdir(ws)) == [IMAGE] and loops_of(ws / IMAGE) == []
        second = gateway.run("sh", "-c", "cat out.txt; head -c 16777216 /dev/zero > big", policy="dl-ws8",
                             workspace=ws)
        assert "from-run-1" in second.stdout and second.returncode == 123, second.stdout + second.stderr
        assert "No space left" in second.stderr
        assert (ws / IMAGE).stat().st_size == 8 * MiB and loops_of(ws / IMAGE) == []
        assert not any(p == str(ws) for p, _, _ in mounts())
    finally:
        remove(ws)


def test_nothing_left_after_sigkill_and_gc(gateway: Gateway) -> None:
    ws = base_dir()
    try:
        proc = subprocess.Popen(gateway.run_argv("sh", "-c", "echo up; sleep 60", policy="dl-ws8", workspace=ws),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=gateway.caller_env())
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert any(p == str(ws) for p, _, _ in mounts()) and loops_of(ws / IMAGE)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        gc = subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config)), capture_output=True,
                            text=True, timeout=60, check=False)
        deadline = time.monotonic() + 10  # the watchdog or gc, whichever comes first
        while time.monotonic() < deadline and (loops_of(ws / IMAGE) or any(p == str(ws) for p, _, _ in mounts())):
            time.sleep(0.1)
        assert loops_of(ws / IMAGE) == [], gc.stdout + gc.stderr
        assert not any(p == str(ws) or p.startswith(str(gateway.state_dir)) for p, _, _ in mounts())
        # a later run still works on the same workspace
        assert gateway.run("true", policy="dl-ws8", workspace=ws).returncode == 0
    finally:
        remove(ws)


def test_normal_runs_leave_no_mount(gateway: Gateway) -> None:
    res = gateway.run("sh", "-c", "echo x > /workspace/a; echo y > /tmp/b", policy="dl-ws")
    assert res.returncode == 0, res.stderr
    sid = sandbox_id(res.stderr)
    assert sid and not any(p.startswith(str(gateway.state_dir)) for p, _, _ in mounts())
