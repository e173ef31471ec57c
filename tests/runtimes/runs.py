"""Inspecting `sandbox run`s from the host: what a run left behind, its revocation records, the processes
in its namespace, and killing its watchdog (shared by the lifecycle, watchdog and docker gc tests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.runtimes.harness import Gateway
from tests.support.procs import alive

# `sandbox gc --grace` of every test gc that may sweep orphans: the netns/cgroup sweep is host-wide, and a
# run being set up (or torn down) by another test worker or test run on this host has a product netns with
# no process in it for a moment; gc leaves product objects younger than the grace alone. Never 0 in a test
# (that would break such a run); a test's own orphan is made older than this (wait_until_older, os.utime).
SWEEP_GRACE = 30.0


def wait_until_older(path: Path, seconds: float) -> None:
    """Sleep until `path` (e.g. a test's own orphan netns) is more than `seconds` old: what makes it an
    orphan to `sandbox gc --grace seconds`. A wait for an age, not a speed assumption."""
    while (age := time.time() - path.stat().st_mtime) <= seconds:
        time.sleep(seconds - age + 0.5)


def product_netns() -> set[str]:
    """Host-global product netns names (`egressgate-<run id>`)."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in netns.splitlines() if line.startswith("egressgate-")}


def product_cgroups() -> set[str]:
    """Host-global product cgroups (`egressgate/<run id>` in every hierarchy), as paths."""
    from egressgate.runtimes.gc import cgroup_dirs

    return {str(p) for p in cgroup_dirs()}


def leftovers(gateway: Gateway) -> dict[str, list[str]]:
    """What the gateway's runs left behind: product objects in the gateway's namespace (nft tables, veths),
    the host-global product netns and cgroups of THIS gateway's runs (runids.py: the names are host-global,
    and runs of other test workers or other test runs on this host come and go there) that appeared since
    the test started (a run an earlier test ended may still be torn down by its watchdog), and run
    records."""
    world = gateway.world
    tables = world.exec(world.gw, "nft", "list", "tables").stdout
    links = world.exec(world.gw, "ip", "-o", "link").stdout
    runs = gateway.state_dir / "runs"
    own = gateway.own_run_ids()
    return {
        "tables": [line for line in tables.splitlines() if "egressgate_" in line],
        "veths": [line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ": egh" in line],
        "netns": sorted(n for n in product_netns() - gateway.netns_baseline if n.removeprefix("egressgate-") in own),
        "cgroups": sorted(c for c in product_cgroups() - gateway.cgroup_baseline if Path(c).name in own),
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
    """SIGKILL the run's watchdog (runtimes/watchdog.py) and wait until it is dead. Dead, not gone: it is
    `sandbox run`'s child, which reaps it only when it ends (the tests kill it next), so until then it stays
    a zombie — one that holds no descriptor (the run's lock is released). Waiting for /proc/<pid> to vanish
    waited out the whole 10 s deadline in every caller and then went on anyway."""
    pid = record["watchdog_pid"]
    assert alive(pid), "the run has no live watchdog"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid), f"the watchdog {pid} outlived SIGKILL"


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


def foreign_holders(devices: list[str]) -> dict[str, list[int]]:
    """Mount namespaces other than this process's that still mount one of `devices` (/dev/loopN), with
    their processes: the copies `ip netns exec` (a world's servers, any worker's) took while an image was
    mounted here. Read from /proc/<pid>/mountinfo, one process per namespace."""
    own = os.readlink("/proc/self/ns/mnt")
    by_ns: dict[str, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                by_ns.setdefault(os.readlink(f"/proc/{entry.name}/ns/mnt"), []).append(int(entry.name))
    held: dict[str, list[int]] = {}
    for ns, pids in by_ns.items():
        if ns == own:
            continue
        for pid in pids:
            try:
                lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
            except OSError:
                continue  # gone: ask the next process of the namespace
            tails = (line.split(" - ", 1)[-1].split() for line in lines)  # fstype, source, options
            if any(len(tail) > 1 and tail[1] in devices for tail in tails):
                held[ns] = pids
            break
    return held


def loops_freed(image: Path, timeout: float = 60.0, held_timeout: float = 900.0) -> list[str]:
    """The loop devices still backed by `image` once the kernel has let them go (or after `timeout`).
    The image's file system is unmounted by teardown, but a mount namespace another process cloned while
    it was mounted (any `ip netns exec`, e.g. a world server of another test worker, which lives as long as
    its module) holds a copy until that process exits; autoclear then frees the device (diskfs.py documents
    the "in use" refusal meanwhile). So past `timeout` the wait goes on while such a foreign namespace
    demonstrably still mounts the device (`foreign_holders`), up to `held_timeout`: the device must still
    be freed, a copy in another namespace only delays it. A wait, not a speed check."""
    from egressgate.runtimes.diskfs import loops_of

    start = time.monotonic()
    while left := loops_of(image):
        waited = time.monotonic() - start
        if waited > held_timeout or (waited > timeout and not foreign_holders(left)):
            break
        time.sleep(0.1 if waited <= timeout else 0.5)
    return left
