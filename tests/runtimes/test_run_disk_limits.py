"""`sandbox run` with kernel-bounded workspace and /tmp (diskfs.py), real gateway, real bwrap: ENOSPC at the
limit, exit 123 when the workspace fills (kill-on-exceed as before), a persistent workspace across two runs,
/tmp bounded, and no mount or loop device of the run left after a normal run or after SIGKILL + gc.
Only this module's own run ids and paths are checked (other tests run in parallel)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes import records
from egressgate.runtimes.diskfs import IMAGE, loops_of, mounts
from egressgate.runtimes.identity import MIN_UID
from tests.networld import World
from tests.runtimes.harness import (
    KEPT_WORKSPACE,
    Gateway,
    base_dir,
    remove,
    running_gateway,
    runtime_policy,
    sandbox_id,
)
from tests.runtimes.runs import loops_freed

pytestmark = pytest.mark.netns
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def gateway(world: World, host_files: Path) -> Iterator[Gateway]:
    policies = {
        "dl-ws": runtime_policy("dl-ws", sandbox__workspace={**KEPT_WORKSPACE, "max_bytes": 2 * MiB}),
        "dl-ws8": runtime_policy("dl-ws8", sandbox__workspace={**KEPT_WORKSPACE, "max_bytes": 8 * MiB}),
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
        assert sorted(os.listdir(ws)) == [IMAGE] and loops_freed(ws / IMAGE) == []
        second = gateway.run("sh", "-c", "cat out.txt; head -c 16777216 /dev/zero > big", policy="dl-ws8",
                             workspace=ws)
        assert "from-run-1" in second.stdout and second.returncode == 123, second.stdout + second.stderr
        assert "No space left" in second.stderr
        assert (ws / IMAGE).stat().st_size == 8 * MiB and loops_freed(ws / IMAGE) == []
        assert not any(p == str(ws) for p, _, _ in mounts())
    finally:
        remove(ws)


def test_mounts_are_the_runs_own_and_go_back_to_root_before_the_unmount(gateway: Gateway) -> None:
    """Per-run uids (identity.py) with bounded file systems: the mounted image's root, what the workload makes
    in it and the /tmp tmpfs belong to the run's own uid (not 65534); at teardown the set-id strip and the
    give-back to root reach the MOUNTED content (checked by mounting the image afterwards)."""
    ws = base_dir()
    mnt = Path(tempfile.mkdtemp(prefix="egDL-mnt-"))
    try:
        script = "echo data > out.txt; echo up; while [ ! -e go ]; do sleep 0.05; done"
        proc = subprocess.Popen(gateway.run_argv("sh", "-c", script, policy="dl-ws8", workspace=ws),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=gateway.caller_env())
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert any(p == str(ws) for p, fstype, _ in mounts() if fstype == "ext4")
        uid = (ws / "out.txt").stat().st_uid
        assert uid >= MIN_UID and (ws.stat().st_uid, ws.stat().st_gid) == (uid, uid)  # the image's root
        (record,) = [r for r in records.all_records(gateway.state_dir) if r.get("uid") == uid]
        tmp = gateway.state_dir / "tmp" / record["run_id"]
        assert any(p == str(tmp) for p, fstype, _ in mounts() if fstype == "tmpfs")
        assert (tmp.stat().st_uid, tmp.stat().st_gid, tmp.stat().st_mode & 0o7777) == (uid, uid, 0o1777)
        (ws / "out.txt").chmod(0o4755)  # planted from the host while it runs
        (ws / "go").touch()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "stripped set-id bits from 1 file(s) in the workspace: out.txt" in err
        assert not any(p == str(ws) for p, _, _ in mounts())
        # a mount namespace another process cloned while the run's image was mounted (another worker's `ip netns
        # exec`) holds the device until it exits; mounting the image meanwhile reuses that device and fails
        # "already mounted or mount point busy" (seen in a stressed full run): wait until the kernel let it go
        assert loops_freed(ws / IMAGE) == []
        subprocess.run(["mount", "-t", "ext4", "-o", "loop,ro", str(ws / IMAGE), str(mnt)], check=True,
                       capture_output=True, timeout=30)
        try:
            st = (mnt / "out.txt").stat()
            assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o755)
            assert mnt.stat().st_uid == 0  # the image's root went back to root too
        finally:
            subprocess.run(["umount", str(mnt)], check=False, capture_output=True, timeout=30)
    finally:
        remove(ws)
        mnt.rmdir()


def test_nothing_left_after_sigkill_and_gc(gateway: Gateway) -> None:
    ws = base_dir()
    try:
        proc = subprocess.Popen(gateway.run_argv("sh", "-c", "echo x > f; echo up; sleep 60", policy="dl-ws8",
                                                 workspace=ws),
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
        assert loops_freed(ws / IMAGE) == [], gc.stdout + gc.stderr
        assert not any(p == str(ws) or p.startswith(str(gateway.state_dir)) for p, _, _ in mounts())
        # the watchdog/gc gave the run's files back to root BEFORE unmounting: the image's content is root's
        out = subprocess.run(["debugfs", "-R", "stat /f", str(ws / IMAGE)], capture_output=True, text=True,
                             timeout=30, check=False)
        assert re.search(r"User:\s+0\s+Group:\s+0\s", out.stdout), out.stdout + out.stderr
        # a later run still works on the same workspace
        assert gateway.run("true", policy="dl-ws8", workspace=ws).returncode == 0
    finally:
        remove(ws)


def test_normal_runs_leave_no_mount(gateway: Gateway) -> None:
    res = gateway.run("sh", "-c", "echo x > /workspace/a; echo y > /tmp/b", policy="dl-ws")
    assert res.returncode == 0, res.stderr
    sid = sandbox_id(res.stderr)
    assert sid and not any(p.startswith(str(gateway.state_dir)) for p, _, _ in mounts())
