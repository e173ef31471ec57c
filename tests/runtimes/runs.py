"""Inspecting `sandbox run`s from the host: what a run left behind, its revocation records, the processes
in its namespace, and killing its watchdog (shared by the lifecycle, watchdog and docker gc tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.runtimes.harness import Gateway


def product_netns() -> set[str]:
    """Host-global product netns names (`egressgate-<run id>`)."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in netns.splitlines() if line.startswith("egressgate-")}


def leftovers(gateway: Gateway) -> dict[str, list[str]]:
    """Product objects in the gateway's namespace (tables, veths), product netns names that appeared since
    the test started (the names are host-global: a run an earlier test ended may still be torn down by
    its watchdog), and run records."""
    world = gateway.world
    tables = world.exec(world.gw, "nft", "list", "tables").stdout
    links = world.exec(world.gw, "ip", "-o", "link").stdout
    runs = gateway.state_dir / "runs"
    return {
        "tables": [line for line in tables.splitlines() if "egressgate_" in line],
        "veths": [line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ": egh" in line],
        "netns": sorted(product_netns() - gateway.netns_baseline),
        "records": sorted(p.name for p in runs.glob("*.json")) if runs.is_dir() else [],
    }


def revocations(gateway: Gateway, sid: str) -> list[dict]:
    return [r for r in gateway.records(predicate=lambda r: r.get("egressgate.operation") == "revocation"
                                       and r.get("egressgate.sandbox.id") == sid)
            if r.get("egressgate.operation") == "revocation" and r.get("egressgate.sandbox.id") == sid]


def netns_commands(run_id: str) -> list[str]:
    """Names of the processes in a run's network namespace (the sandbox's processes)."""
    res = subprocess.run(["ip", "netns", "pids", f"egressgate-{run_id}"], capture_output=True, text=True,
                         check=False)
    out = []
    for pid in res.stdout.split():
        try:
            out.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            continue
    return out


def kill_watchdog(record: dict) -> None:
    """SIGKILL the run's watchdog (runtimes/watchdog.py) and wait until it is gone."""
    pid = record["watchdog_pid"]
    assert Path(f"/proc/{pid}").exists(), "the run has no live watchdog"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # it is not our child: init reaps it


def wait_for_workload(gateway: Gateway, proc: subprocess.Popen[str], command: str = "sleep",
                       timeout: float = 30) -> dict:
    """The run's record once its workload (`command`) runs inside the sandbox: killing `sandbox run`
    earlier would race bubblewrap's own start-up (its --die-with-parent is set after its fork)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in (gateway.state_dir / "runs").glob("*.json"):
            record = json.loads(path.read_text())
            if (record.get("owner_pid") == proc.pid and record.get("workload_pid")
                    and command in netns_commands(record["run_id"])):
                return record
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the workload did not start")


def loops_freed(image: Path, timeout: float = 60.0) -> list[str]:
    """The loop devices still backed by `image` once the kernel has let them go (or after `timeout`).
    The image's file system is unmounted by teardown, but a mount namespace another process cloned while
    it was mounted (any `ip netns exec`, bwrap or container start on the host, e.g. another test worker)
    holds a copy until that process exits; autoclear then frees the device (diskfs.py documents the
    "in use" refusal meanwhile). A wait, not a speed check."""
    from egressgate.runtimes.diskfs import loops_of

    deadline = time.monotonic() + timeout
    while (left := loops_of(image)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
