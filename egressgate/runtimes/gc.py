"""`egressgate sandbox gc`: remove what runs killed with SIGKILL left behind.

Two passes. (1) Run records (`state_dir/runs/*.json`) whose `sandbox run` (owner_pid) is dead: every object
the record names is removed (processes in its namespace, cgroups and of its uid killed first, set-id bits in
its persistent workspace stripped and audited, the workspace given back to root), its sandbox is revoked on
the gateway (when reachable), then the record, which frees its address slot and uid. (2) Orphans no record
claims: product-named objects (`egressgate-<id>` netns,
`egressgate_<id>` nft tables, `egh<id>` veths, `egressgate/<id>` cgroups) whose run id no live record holds.
Only exact product names (`<id>` = 10 hex digits) are ever touched, and an orphan netns or cgroup must be
older than `grace` seconds and empty of processes, so a run that is being set up right now (its record may
live in another state dir) is never broken. A run of this version also holds a host-wide lock (runlock.py)
from its first host object until its watchdog is done: every object of a run id whose lock is held is left
alone whatever `--grace` says, so the grace only matters for runs of older versions.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from egressgate.runtimes import endpoints, identity, nftables, records, runlock, setid
from egressgate.runtimes.netns import NETNS_PREFIX, delete_netns
from egressgate.runtimes.plumbing import delete_link
from egressgate.runtimes.workload import release_workspace

DEFAULT_STATE_DIR = Path("/run/egressgate")
CGROUP_ROOT = Path("/sys/fs/cgroup")
ID = r"[0-9a-f]{10}"


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def netns_pids(name: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False, timeout=30)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _younger(path: Path, now: float, grace: float) -> bool:
    """True when `path` changed less than `grace` seconds ago, or is gone: the sweep lists first and looks
    after, and a run of another state dir (or its own teardown) may remove the object in between. A vanished
    object is not an orphan to remove (it crashed gc with FileNotFoundError when two gateways shared a host)."""
    try:
        return now - path.stat().st_mtime < grace
    except FileNotFoundError:
        return True


def list_netns() -> list[str]:
    netns_dir = Path("/run/netns")
    if not netns_dir.is_dir():
        return []
    return [p.name for p in netns_dir.iterdir() if re.fullmatch(NETNS_PREFIX + ID, p.name)]


def list_veths() -> list[str]:
    res = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True,
                         check=False, timeout=30)
    out = []
    for line in res.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if re.fullmatch("egh" + ID, name):
                out.append(name)
    return out


def cgroup_dirs() -> list[Path]:
    """`egressgate/<id>` groups in every hierarchy (v1 controllers and the cgroup2 mount)."""
    found: list[Path] = []
    if not CGROUP_ROOT.is_dir():
        return found
    for base in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()]:
        parent = base / "egressgate"
        if parent.is_dir():
            found += [p for p in parent.iterdir() if p.is_dir() and re.fullmatch(ID, p.name)]
    return found


def remove_cgroup(path: Path) -> None:
    """Kill what is left in the group (and its children), then remove it bottom-up."""
    for sub in [*sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True), path]:
        with contextlib.suppress(OSError):
            _kill_pids([int(x) for x in (sub / "cgroup.procs").read_text().split()])
    for sub in [*sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True), path]:
        for _ in range(20):
            try:
                sub.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)  # killed processes take a moment to leave the group


def revoke(info: endpoints.GatewayInfo | None, record: dict[str, Any], ended_by: str = "gc") -> str | None:
    """Revoke the record's sandbox (`ended_by`: gc, or watchdog for runtimes/watchdog.py); returns the
    problem, or None when revoked (or there was nothing to revoke)."""
    if not record.get("sandbox_id"):
        return None
    if info is None:  # the record (and its address slot) stays until the sandbox is revoked
        return (f"cannot revoke {record['sandbox_id']}: the gateway is not running (its var dir has no live "
                "gateway.json); run `sandbox gc` again once it runs")
    from egressgate.runtimes.adminapi import AdminUnreachable, call

    try:
        token = info.admin_token_file.read_text().strip()
        status, data = call(info.endpoints.admin, "DELETE", f"/v1/sandboxes/{record['sandbox_id']}", token,
                            {"outcome": {"runtime": record.get("runtime") or "unknown", "exit_code": None,
                                         "status": None, "signal": None, "limit": None, "duration_ms": None,
                                         "ended_by": ended_by, **_setid_outcome(record)}})
    except (OSError, AdminUnreachable) as exc:
        return f"cannot revoke {record['sandbox_id']}: {exc}"
    if status not in (200, 404):
        return f"revocation of {record['sandbox_id']} failed ({status}): {data}"
    return None


def _setid_outcome(record: dict[str, Any]) -> dict[str, list[str]]:
    """`setid_stripped` for the revocation's outcome (audited as egressgate.run.setid_stripped), when the
    leftover path stripped any (strip_leftover_setid)."""
    found = record.get("setid_stripped")
    if isinstance(found, list) and found and all(isinstance(x, str) for x in found):
        return {"setid_stripped": found[:setid.MAX_REPORTED]}
    return {}


def strip_leftover_setid(record: dict[str, Any], state_dir: Path | None) -> list[str]:
    """A dead run's persistent workspace: clear every set-id bit in it, whoever owns the file (the give-back
    to root only touches the run uid's files), as the run's own teardown would have (runtimes/setid.py).
    The paths go into the record (`setid_stripped`), so the revocation audits them even when it has to be
    retried by a later gc. A temporary workspace is deleted whole; a system directory is never walked."""
    ws = record.get("workspace")
    if not isinstance(ws, str) or not ws.startswith("/") or record.get("temp_workspace"):
        return []
    from egressgate.runtimes.workload import SetupFailed, check_workspace

    try:
        check_workspace(Path(ws))
    except (SetupFailed, OSError):
        return []
    found = setid.strip_setid(ws)
    if not found:
        return []
    earlier = record.get("setid_stripped") if isinstance(record.get("setid_stripped"), list) else []
    record["setid_stripped"] = list(dict.fromkeys([*earlier, *found]))[:setid.MAX_REPORTED]
    run_id = str(record.get("run_id"))
    if state_dir is not None and re.fullmatch(ID, run_id) and records.read(state_dir, run_id) is not None:
        records.update(state_dir, run_id, setid_stripped=record["setid_stripped"])
    return [f"set-id bits from {len(found)} file(s) in {ws}: {', '.join(found[:5])}"]


def clean_record(record: dict[str, Any], state_dir: Path | None = None) -> list[str]:
    """Remove every object a dead run's record names; returns what was removed.

    Only the names this run's own id gives (netns.netns_name, addressing.slot_address, nftables,
    limits.py's `egressgate/<id>` groups, docker.py's container name) are touched: a record is data, and
    neither gc nor a run's watchdog may delete another run's objects because a record says so."""
    removed = []
    run_id = str(record.get("run_id"))
    if not re.fullmatch(ID, run_id):
        return removed
    ns = record.get("netns")
    if ns == NETNS_PREFIX + run_id:
        _kill_pids(netns_pids(ns))
        if delete_netns(ns):
            removed.append(f"netns {ns}")
    # the record names its cgroups only once they exist (limits.py creates them in one step): groups of
    # this run id a SIGKILL left unrecorded are found by name
    named = {Path(path) for path in record.get("cgroups") or []}
    named |= {p for p in cgroup_dirs() if p.name == run_id}
    for p in sorted(named):
        if p.name == run_id and p.parent.name == "egressgate" and p.is_dir() and p.is_relative_to(CGROUP_ROOT):
            remove_cgroup(p)
            removed.append(f"cgroup {p}")
    if record.get("host_if") == f"egh{run_id}" and delete_link(record["host_if"]):
        removed.append(f"veth {record['host_if']}")
    table = record.get("nft_table")
    if table == nftables.TABLE_PREFIX + run_id and nftables.delete_table(table):
        removed.append(f"nft table {table}")
    if record.get("container"):
        from egressgate.runtimes import registry

        module = registry.ADAPTERS.get(record.get("runtime", ""), "").partition(":")[0]
        if module:
            import importlib

            hook = getattr(importlib.import_module(module), "gc_record", None)
            if hook is not None:
                removed += hook(record)
    # the run's own uid (runtimes/identity.py): whatever still runs as it is a leftover of this run; its
    # persistent workspace goes back to root, so the run that gets the uid next cannot read it. Before the
    # bounded file systems are unmounted: a bounded workspace's content is the mounted image's
    uid = record.get("uid")
    ours = isinstance(uid, int) and not isinstance(uid, bool) and uid >= identity.MIN_UID
    if ours and identity.kill_uid(uid):
        removed.append(f"processes of uid {uid}")
    removed += strip_leftover_setid(record, state_dir)  # after every kill, before the chown (silent about it)
    if ours and record.get("workspace") and release_workspace(Path(str(record["workspace"])), int(uid)):
        removed.append(f"workspace {record['workspace']} given back to root")
    if record.get("disk_mounts") and state_dir is not None:  # after the kills, the container removal, the chown
        from egressgate.runtimes import diskfs

        for entry in reversed(record["disk_mounts"]):
            if isinstance(entry, dict) and not diskfs.release_entry(run_id, state_dir, entry):
                removed.append(f"mount {entry.get('target') or entry.get('image')}")
    vm = record.get("vm_dir")  # microvm: the run's workspace image (after the kills: QEMU held it)
    if vm and state_dir is not None and Path(vm) == state_dir / "microvm" / run_id:
        from egressgate.runtimes.microvm.adapter import remove_vm_dir

        if remove_vm_dir(state_dir, run_id):
            removed.append(f"microvm dir {vm}")
    ws = record.get("temp_workspace")
    if ws and state_dir is not None and Path(ws) == state_dir / "workspaces" / run_id and Path(ws).is_dir():
        shutil.rmtree(ws, ignore_errors=True)
        removed.append(f"workspace {ws}")
    return removed


def collect(var_dir: Path, state_dir: Path | None = None, grace: float = 60.0) -> tuple[list[str], list[str]]:
    """Both passes; returns (what was removed, problems)."""
    try:
        info: endpoints.GatewayInfo | None = endpoints.load(var_dir)
    except endpoints.GatewayNotRunning:
        info = None
    state_dir = state_dir or (info.state_dir if info else DEFAULT_STATE_DIR)
    removed: list[str] = []
    problems: list[str] = []
    live: set[str] = set()
    for record in records.all_records(state_dir):
        run_id = record["run_id"]
        if records.pid_alive(record.get("owner_pid")):
            live.add(run_id)
            continue
        removed += [f"{what} (run {run_id})" for what in clean_record(record, state_dir)]
        problem = revoke(info, record)
        if problem:
            problems.append(problem)
            live.add(run_id)  # keep the record: the revocation is retried by the next gc
            continue
        if record.get("sandbox_id"):
            removed.append(f"sandbox {record['sandbox_id']} revoked (run {run_id})")
        records.remove(state_dir, run_id)
        removed.append(f"run record {run_id}")
    try:  # runs of any state dir on this host, alive or being cleaned by their watchdog
        live |= runlock.held()
    except runlock.LockFailed as exc:  # cannot tell live runs of other state dirs from orphans: no sweep
        problems.append(f"{exc}; orphan sweep skipped")
        return removed, problems
    now = time.time()
    for name in list_netns():
        run_id = name[len(NETNS_PREFIX):]
        if run_id in live or _younger(Path("/run/netns") / name, now, grace) or netns_pids(name):
            continue
        if delete_netns(name):
            removed.append(f"orphan netns {name}")
    for table in nftables.list_tables():
        ours = re.fullmatch(nftables.TABLE_PREFIX + ID, table) and table[len(nftables.TABLE_PREFIX):] not in live
        if ours and nftables.delete_table(table):
            removed.append(f"orphan nft table {table}")
    for veth in list_veths():
        if veth[3:] not in live and delete_link(veth):
            removed.append(f"orphan veth {veth}")
    for group in cgroup_dirs():
        if group.name in live or _younger(group, now, grace):
            continue
        try:
            if (group / "cgroup.procs").read_text().strip():
                continue
        except OSError:
            continue
        remove_cgroup(group)
        removed.append(f"orphan cgroup {group}")
    from egressgate.runtimes import diskfs, docker

    removed += diskfs.orphans(state_dir, live)
    vm_root = state_dir / "microvm"
    if vm_root.is_dir():
        for vm in vm_root.iterdir():
            if re.fullmatch(ID, vm.name) and vm.name not in live and not _younger(vm, now, grace):
                shutil.rmtree(vm, ignore_errors=True)
                removed.append(f"orphan microvm dir {vm}")

    gone, trouble = docker.gc_orphans(live, info.docker_host if info else None)
    return removed + gone, problems + trouble
