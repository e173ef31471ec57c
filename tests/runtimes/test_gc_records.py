"""`sandbox gc` treats a run record as data: it removes only objects whose names the record's own run id
gives (the veth `egh<id>`, the temp workspace `state_dir/workspaces/<id>`), never a link or a directory a
record merely names. Real links in a throwaway network namespace, real directories."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from egressgate.runtimes.gc import clean_record
from egressgate.runtimes.plumbing import in_netns


def links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True, timeout=30).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.mark.netns
def test_gc_removes_only_what_the_run_id_names() -> None:
    run_id = uuid.uuid4().hex[:10]
    ns = f"egV-gc{run_id}"
    state = Path(tempfile.mkdtemp(prefix="egV-"))
    outsider = Path(tempfile.mkdtemp(prefix="egV-outsider-"))
    own_ws = state / "workspaces" / run_id
    own_ws.mkdir(parents=True)
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:
        def scenario() -> tuple[list[str], set[str], list[str], set[str]]:
            for name, peer in (("egVkeep0", "egVkeep1"), (f"egh{run_id}", f"egs{run_id}")):
                subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", peer], check=True,
                               timeout=30)
            hostile = clean_record({"run_id": run_id, "host_if": "egVkeep0", "temp_workspace": str(outsider)},
                                   state)
            after_hostile = links()
            own = clean_record({"run_id": run_id, "host_if": f"egh{run_id}", "temp_workspace": str(own_ws)},
                               state)
            return hostile, after_hostile, own, links()

        hostile, after_hostile, own, after_own = in_netns(f"/run/netns/{ns}", scenario)
        assert hostile == [] and "egVkeep0" in after_hostile and outsider.is_dir()
        # positive control: the run's own veth and temp workspace are removed
        assert f"egh{run_id}" not in after_own and not own_ws.exists(), own
        assert own == [f"veth egh{run_id}", f"workspace {own_ws}"]
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, timeout=30)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(outsider, ignore_errors=True)


@pytest.mark.netns
def test_a_record_cannot_name_another_runs_netns_table_or_cgroup() -> None:
    """gc and a run's watchdog (runtimes/watchdog.py) both call clean_record: a record of run X naming run
    Y's namespace, nft table or cgroup (product names, just not X's) must leave them alone."""
    own, other = uuid.uuid4().hex[:10], uuid.uuid4().hex[:10]
    scratch = f"egW-gc{own}"
    victim_ns = f"egressgate-{other}"
    victim_cg = Path("/sys/fs/cgroup/pids/egressgate") / other
    subprocess.run(["ip", "netns", "add", scratch], check=True, timeout=30)
    subprocess.run(["ip", "netns", "add", victim_ns], check=True, timeout=30)
    victim_cg.mkdir(parents=True)
    try:
        def tables() -> str:
            return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True,
                                  timeout=30).stdout

        def scenario() -> tuple[list[str], str, list[str], str]:
            subprocess.run(["nft", "add", "table", "inet", f"egressgate_{other}"], check=True, timeout=30)
            hostile = clean_record({"run_id": own, "netns": victim_ns, "nft_table": f"egressgate_{other}",
                                    "cgroups": [str(victim_cg)]})
            after_hostile = tables()
            victims = clean_record({"run_id": other, "netns": victim_ns, "nft_table": f"egressgate_{other}",
                                    "cgroups": [str(victim_cg)]})
            return hostile, after_hostile, victims, tables()

        hostile, after_hostile, victims, after = in_netns(f"/run/netns/{scratch}", scenario)
        assert hostile == [], hostile
        assert f"egressgate_{other}" in after_hostile
        # positive control: the same record under its own run id removes them
        assert set(victims) == {f"netns {victim_ns}", f"nft table egressgate_{other}", f"cgroup {victim_cg}"}
        assert f"egressgate_{other}" not in after and not victim_cg.exists()
        assert not Path(f"/run/netns/{victim_ns}").exists()
    finally:
        subprocess.run(["ip", "netns", "del", scratch], check=False, timeout=30)
        subprocess.run(["ip", "netns", "del", victim_ns], capture_output=True, check=False, timeout=30)
        if victim_cg.exists():
            victim_cg.rmdir()
