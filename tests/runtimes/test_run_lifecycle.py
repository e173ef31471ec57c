"""`sandbox run` end to end: a new admission per run, exit codes, the command allow-list, signals, and
cleanup after SIGKILL (of `sandbox run` and its watchdog) by `sandbox gc` (nothing left in the host namespace)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from egressgate.runtimes.gc import CGROUP_ROOT
from egressgate.runtimes.records import new_run_id
from tests.runtimes.harness import Gateway, base_dir, remove, sandbox_id
from tests.runtimes.runs import (
    SWEEP_GRACE,
    kill_watchdog,
    leftovers,
    netns_commands,
    product_netns,
    revocations,
    wait_for_workload,
    wait_until_older,
)
from tests.support.launcher import EGRESSGATE

pytestmark = pytest.mark.netns


def test_every_run_is_a_new_admission_only_the_workspace_survives(gateway: Gateway) -> None:
    ws = base_dir()
    try:
        first = gateway.run("sh", "-c", 'echo "$HTTP_PROXY" > /workspace/old-proxy; echo kept > /workspace/note',
                            policy="rt-allow", workspace=ws)
        assert first.returncode == 0, first.stderr
        # run 2: the workspace file is there; run 1's token is refused by the proxy (407), its own works
        second = gateway.run("sh", "-c",
                             'cat /workspace/note; '
                             'curl -s -o /dev/null -w "%{http_code}\\n" --max-time 10 -x "$(cat /workspace/old-proxy)" '
                             'https://api.allowed.test/; '
                             'curl -s -o /dev/null -w "%{http_code}\\n" --max-time 10 https://api.allowed.test/',
                             policy="rt-allow", workspace=ws)
        assert second.returncode == 0, second.stderr
        lines = second.stdout.split()
        assert lines[0] == "kept"
        assert lines[1] in ("407", "000"), second.stdout  # curl reports the CONNECT refusal as 000
        assert lines[2] == "200", second.stdout
        assert sandbox_id(first.stderr) != sandbox_id(second.stderr)
        assert str(gateway.audit_path) in first.stderr  # where the audit records are
    finally:
        remove(ws)


def test_parallel_runs_get_their_own_link_and_identity(gateway: Gateway) -> None:
    """Two runs at once: distinct addresses, ids and host objects; both reach the allowed upstream
    transparently (each identified by its own source address)."""
    curl = ("curl", "-sS", "--noproxy", "*", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code} ",
            "https://api.allowed.test/")
    procs = [gateway.popen_run(*curl, policy="rt-allow") for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0 and out.startswith("200 "), out + err
    sids = {sandbox_id(err) for _, err in outs}
    ips = {err.split(", netns, ")[1].split(")")[0] for _, err in outs}
    assert len(sids) == 2 and len(ips) == 2, outs
    assert leftovers(gateway) == {"tables": [], "veths": [], "netns": [], "cgroups": [], "records": []}


def test_old_token_is_refused_with_407(gateway: Gateway) -> None:
    """The same property, observed on the CONNECT itself (not through curl's summary)."""
    first = gateway.run("sh", "-c", 'echo "$HTTP_PROXY"', policy="rt-allow")
    old_proxy = first.stdout.strip()
    second = gateway.run("curl", "-sS", "-o", "/dev/null", "-D", "-", "--max-time", "10", "-x", old_proxy,
                         "https://api.allowed.test/", policy="rt-allow")
    assert "407" in second.stdout.splitlines()[0], second.stdout + second.stderr


def test_exit_status_and_signal_are_reported(gateway: Gateway) -> None:
    assert gateway.run("sh", "-c", "exit 7", policy="rt-allow").returncode == 7
    killed = gateway.run("sh", "-c", "kill -9 $$", policy="rt-allow")
    assert killed.returncode == 137
    sid = sandbox_id(killed.stderr)
    (record,) = revocations(gateway, sid)
    assert record["egressgate.run.exit_code"] in (137, "137") and record["egressgate.run.runtime"] == "netns"


def test_command_allow_list(gateway: Gateway) -> None:
    refused = gateway.run("sh", "-c", "true", policy="rt-commands")
    assert refused.returncode == 120
    assert "execution.commands" in refused.stderr and "'sh'" in refused.stderr
    assert gateway.run("/bin/true", policy="rt-commands").returncode == 0  # basename `true` is allowed
    assert leftovers(gateway)["records"] == []


def test_gateway_not_running_is_a_setup_failure(gateway: Gateway) -> None:
    empty = base_dir()
    try:
        res = subprocess.run(gateway.cmd("sandbox", "run", "--var-dir", str(empty), "--policy", "rt-allow", "--",
                                         "true"), capture_output=True, text=True, timeout=30, check=False)
        assert res.returncode == 120
        assert "gateway.json does not exist" in res.stderr
    finally:
        remove(empty)


def test_sigterm_kills_the_sandbox_and_cleans_up(gateway: Gateway) -> None:
    proc = gateway.popen_run("sleep", "60", policy="rt-allow")
    record = wait_for_workload(gateway, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert leftovers(gateway) == {"tables": [], "veths": [], "netns": [], "cgroups": [], "records": []}
    assert not Path(f"/proc/{record['workload_pid']}").exists()
    (rev,) = revocations(gateway, record["sandbox_id"])
    assert rev["egressgate.run.signal"] in (15, "15")


def test_sigkill_then_gc_leaves_nothing(gateway: Gateway) -> None:
    """A run with a pids limit (so it has cgroups too) killed with SIGKILL together with its watchdog (the
    watchdog alone cleans up otherwise: test_watchdog.py); `sandbox gc` removes the rest."""
    proc = gateway.popen_run("sleep", "60", policy="rt-pids")
    record = wait_for_workload(gateway, proc)
    cgroups = [Path(p) for p in record.get("cgroups") or []]
    assert cgroups and all(p.is_dir() for p in cgroups), record
    kill_watchdog(record)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=20)
    # the sandbox's processes die with `sandbox run` (PDEATHSIG on bwrap, --die-with-parent inside)
    deadline = time.monotonic() + 10
    while netns_commands(record["run_id"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert netns_commands(record["run_id"]) == []
    proc.communicate(timeout=10)
    left = leftovers(gateway)
    # positive control: SIGKILL left the run's objects behind (so gc has something to prove)
    assert left["records"] == [f"{record['run_id']}.json"]
    assert left["veths"] == [f"egh{record['run_id']}"] and left["netns"] == [f"egressgate-{record['run_id']}"]
    assert left["cgroups"] == sorted(map(str, cgroups)) and len(left["tables"]) == 1
    gc = subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config)), capture_output=True,
                        text=True, timeout=60, check=False)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert leftovers(gateway) == {"tables": [], "veths": [], "netns": [], "cgroups": [], "records": []}
    assert [p for p in cgroups if p.exists()] == []
    (rev,) = revocations(gateway, record["sandbox_id"])
    assert rev["egressgate.run.ended_by"] == "gc"
    again = subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config)), capture_output=True,
                           text=True, timeout=60, check=False)
    # nothing of this gateway's is left to do: no record, no revocation, no object of its runs (an "orphan"
    # line can only be another test run's host-global object, e.g. of a concurrent test worker)
    assert again.returncode == 0, again.stdout + again.stderr
    own = gateway.own_run_ids()
    assert [line for line in again.stdout.splitlines()
            if not line.startswith("orphan ") or any(run_id in line for run_id in own)] == [], again.stdout


def test_gc_removes_unrecorded_product_objects_only(gateway: Gateway) -> None:
    """Orphans (no record at all, e.g. a lost state dir): product-named objects go, anything else stays.

    The gc keeps a grace (SWEEP_GRACE, not 0): its netns/cgroup sweep is host-wide, and a run another test
    worker is setting up right now has a product netns with no process in it yet; the grace is what keeps
    gc's hands off it (as it does for an operator's gc). So the orphan netns is made first and gc runs once
    it is older than the grace (a netns's age cannot be backdated: nsfs refuses utime); the orphan cgroup
    is backdated."""
    world = gateway.world
    run_id = new_run_id()  # not a fixed id: another checkout's test run may do the same on this host now
    world.exec(world.gw, "nft", "add", "table", "inet", f"egressgate_{run_id}")
    world.exec(world.gw, "nft", "add", "table", "inet", "egNkeep")
    world.exec(world.gw, "ip", "link", "add", f"egh{run_id}", "type", "veth", "peer", "name", "egNpeer")
    world.exec(world.gw, "ip", "link", "add", "egNkeep0", "type", "veth", "peer", "name", "egNkeep1")
    netns = f"egressgate-{run_id}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    # a real hierarchy (gc reads cgroup.procs): v1's pids controller, or the cgroup2 root
    hierarchy = next(b for b in (CGROUP_ROOT / "pids", CGROUP_ROOT) if (b / "cgroup.procs").exists())
    cgroup = hierarchy / "egressgate" / run_id
    fresh = hierarchy / "egressgate" / new_run_id()  # a "concurrent run's" group: younger than the grace
    cgroup.mkdir(parents=True)
    try:
        # positive control: the orphans exist, and are of no run this gateway knows
        assert netns in product_netns() and cgroup.is_dir() and run_id not in gateway.own_run_ids()
        wait_until_older(Path("/run/netns", netns), SWEEP_GRACE)
        # backdated just past the grace, just before the gc: younger than the default grace (60 s) that
        # every other test's gc keeps, so only this gc can take it
        old = time.time() - SWEEP_GRACE - 5
        os.utime(cgroup, (old, old))
        fresh.mkdir()
        gc = subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config),
                                        "--grace", str(SWEEP_GRACE)),
                            capture_output=True, text=True, timeout=60, check=False)
        assert gc.returncode == 0, gc.stderr
        assert leftovers(gateway) == {"tables": [], "veths": [], "netns": [], "cgroups": [], "records": []}
        assert netns not in product_netns() and not cgroup.exists(), gc.stdout
        assert f"orphan netns {netns}" in gc.stdout and f"orphan cgroup {cgroup}" in gc.stdout, gc.stdout
        assert fresh.is_dir(), gc.stdout  # within the grace: left alone
        assert "egNkeep" in world.exec(world.gw, "nft", "list", "tables").stdout
        assert "egNkeep0" in world.exec(world.gw, "ip", "-o", "link").stdout
    finally:
        world.exec(world.gw, "nft", "delete", "table", "inet", "egNkeep")
        world.exec(world.gw, "ip", "link", "del", "egNkeep0")
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        for group in (cgroup, fresh):
            with contextlib.suppress(OSError):
                group.rmdir()


def test_console_script_is_used() -> None:
    assert Path(EGRESSGATE).exists()
