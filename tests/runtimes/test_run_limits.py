"""Resource limits through `egressgate sandbox run`: each limit ends the run with its own exit code
(base.py: 121 memory, 122 pids, 123 workspace bytes, 124 wall time) and is audited in the revocation
record (egressgate.run.limit). Positive controls: the same workload under a policy without the limit
completes (so the limit, not the workload, ended the run).

Safety (PREAMBLE): every workload here is bounded by construction (a fixed number of forks, a fixed
amount of memory or bytes) AND runs under the harness's independent safety net (RLIMIT_NPROC for the
sandbox uid, RLIMIT_AS for the tree), which the workload checks before it starts.
"""

from __future__ import annotations

import time

import pytest

from tests.runtimes.harness import SAFETY_AS, SAFETY_NPROC, Gateway, base_dir, remove, sandbox_id

pytestmark = pytest.mark.netns

PY = "/usr/bin/python3"

# refuses to start unless the safety net is in place (verified inside the workload, before it forks/allocates)
NET_CHECK = f"""
import resource, sys
nproc, mem = resource.getrlimit(resource.RLIMIT_NPROC)[0], resource.getrlimit(resource.RLIMIT_AS)[0]
if nproc < 0 or nproc > {SAFETY_NPROC} or mem < 0 or mem > {SAFETY_AS}:  # RLIM_INFINITY is -1
    print("no safety net", flush=True); sys.exit(99)
"""

# at most 200 processes in all (each sleeps 20 s and exits), whatever the pids limit says
FORKS = NET_CHECK + """
import os, time
made = failed = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(20); os._exit(0)
        made += 1
    except OSError:
        failed += 1
print(f"made={made} failed={failed}", flush=True)
sys.exit(1 if failed else 0)
"""

# 256 MiB in 8 MiB steps, every page written
MEMORY = NET_CHECK + """
chunks = []
for i in range(32):
    chunks.append(bytearray(b"\\x01") * (8 * 2**20))
    print(f"allocated={8 * (i + 1)}MiB", flush=True)
"""


def outcome(gateway: Gateway, sid: str) -> dict:
    (rev,) = [r for r in gateway.records(predicate=lambda r: r.get("egressgate.operation") == "revocation"
                                         and r.get("egressgate.sandbox.id") == sid)
              if r.get("egressgate.operation") == "revocation" and r.get("egressgate.sandbox.id") == sid]
    return {k.removeprefix("egressgate.run."): v for k, v in rev.items() if k.startswith("egressgate.run.")}


def test_fork_storm_hits_the_pids_limit(gateway: Gateway) -> None:
    res = gateway.run(PY, "-c", FORKS, policy="rt-pids", timeout=90)
    assert "no safety net" not in res.stdout
    assert res.returncode == 122, res.stdout + res.stderr
    made = int(res.stdout.split("made=")[1].split()[0])
    assert made < 32, res.stdout  # the cgroup held it (pids_max 32 counts the sandbox's own processes too)
    assert outcome(gateway, sandbox_id(res.stderr))["limit"] == "pids"
    # positive control: without the limit the same storm completes (all 200 forks, exit 0)
    control = gateway.run(PY, "-c", FORKS.replace("time.sleep(20)", "time.sleep(2)"), policy="rt-nomask",
                          timeout=90)
    assert control.returncode == 0 and "made=200 failed=0" in control.stdout, control.stdout + control.stderr


def test_memory_growth_hits_the_memory_limit(gateway: Gateway) -> None:
    res = gateway.run(PY, "-c", MEMORY, policy="rt-mem", timeout=90)
    assert "no safety net" not in res.stdout
    assert res.returncode == 121, res.stdout + res.stderr
    assert "allocated=256MiB" not in res.stdout
    out = outcome(gateway, sandbox_id(res.stderr))
    assert out["limit"] == "memory" and out["exit_code"] in (121, "121")
    control = gateway.run(PY, "-c", MEMORY, policy="rt-nomask", timeout=90)
    assert control.returncode == 0 and "allocated=256MiB" in control.stdout, control.stdout + control.stderr


def test_sleep_past_wall_time_is_killed(gateway: Gateway) -> None:
    begin = time.monotonic()
    res = gateway.run("sh", "-c", "sleep 30 & sleep 30", policy="rt-wall", timeout=60)
    assert res.returncode == 124, res.stderr
    assert time.monotonic() - begin < 15
    out = outcome(gateway, sandbox_id(res.stderr))
    assert out["limit"] == "wall_time" and out["exit_code"] in (124, "124")
    # positive control: a workload inside the wall time ends normally under the same policy
    assert gateway.run("sleep", "0.2", policy="rt-wall").returncode == 0


def test_workspace_fill_hits_the_byte_limit(gateway: Gateway) -> None:
    ws = base_dir()
    try:
        # 20 MiB at most, 64 KiB at a time, slowly enough for the watch to see it grow
        fill = ("i=0; while [ $i -lt 320 ]; do head -c 65536 /dev/zero >> /workspace/fill || exit 3; "
                "i=$((i+1)); sleep 0.01; done; echo filled")
        res = gateway.run("sh", "-c", fill, policy="rt-ws", workspace=ws, timeout=90)
        assert res.returncode == 123, res.stdout + res.stderr
        assert "filled" not in res.stdout
        assert outcome(gateway, sandbox_id(res.stderr))["limit"] == "workspace_bytes"
        assert "No space left" in res.stderr  # the kernel refused the bytes (ext4 image of max_bytes)
        # positive control: the same fill under a policy without max_bytes completes
        remove(ws)
        ws = base_dir()
        control = gateway.run("sh", "-c", fill, policy="rt-allow", workspace=ws, timeout=90)
        assert control.returncode == 0 and "filled" in control.stdout, control.stderr
    finally:
        remove(ws)
