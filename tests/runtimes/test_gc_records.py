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
