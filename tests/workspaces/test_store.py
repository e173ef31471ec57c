"""The workspace store (runtimes/workspaces.py): names vs paths, the lock, and settling a staged write —
approved: swapped in with one rename; denied or expired: removed; approved over a workspace that changed
since staging: discarded. Real files and the real renameat2."""

from __future__ import annotations

from pathlib import Path

import pytest

from egressgate.runtimes import manifest
from egressgate.runtimes.workspaces import Store, WorkspaceError, all_stores, is_name, settle


def test_names_and_paths() -> None:
    assert is_name("proj") and is_name("a.b_c-1")
    assert not is_name("./proj") and not is_name("Proj") and not is_name("..") and not is_name("a/b")
    with pytest.raises(WorkspaceError, match="not a workspace name"):
        Store(Path("/nonexistent"), name="Bad")


def test_one_run_at_a_time(tmp_path: Path) -> None:
    a = Store(tmp_path, name="proj")
    a.lock()
    with pytest.raises(WorkspaceError, match="in use"):
        Store(tmp_path, name="proj").lock()
    a.unlock()
    b = Store(tmp_path, name="proj")
    b.lock()  # positive control: free again
    b.unlock()


def staged_write(tmp_path: Path) -> tuple[Store, Path]:
    """A named workspace with a saved manifest and one run's staged copy waiting for apr-1."""
    store = Store(tmp_path, name="proj")
    store.create()
    (store.data / "kept.txt").write_text("old\n")
    entries = manifest.scan(store.data)
    store.store({"name": "proj", "manifest_hash": manifest.manifest_hash(entries), "entries": entries})
    staged = store.stage("run1")
    (staged / "kept.txt").write_text("new\n")
    (staged / "added.txt").write_text("added\n")
    new_entries = manifest.scan(staged)
    state = store.load() or {}
    state["pending"] = {
        "approval_id": "apr-1",
        "run_id": "run1",
        "count": 2,
        "base_manifest_hash": state["manifest_hash"],
        "next": {"manifest_hash": manifest.manifest_hash(new_entries), "entries": new_entries},
    }
    store.store(state)
    return store, staged


def test_approved_write_is_swapped_in_and_becomes_the_manifest(tmp_path: Path) -> None:
    store, staged = staged_write(tmp_path)
    data_inode = store.data.stat().st_ino
    attrs = settle(tmp_path, "apr-1", "approved", "alice")
    assert attrs is not None and attrs["action"] == "write_applied" and attrs["by"] == "alice"
    assert (store.data / "kept.txt").read_text() == "new\n" and (store.data / "added.txt").exists()
    assert store.data.stat().st_ino != data_inode  # one rename, not a copy into the old tree
    state = store.load() or {}
    assert "pending" not in state
    assert state["manifest_hash"] == manifest.manifest_hash(manifest.scan(store.data))
    assert not staged.exists()
    assert settle(tmp_path, "apr-1", "approved") is None  # idempotent


@pytest.mark.parametrize("outcome", ["denied", "expired"])
def test_denied_or_expired_write_is_discarded(tmp_path: Path, outcome: str) -> None:
    store, staged = staged_write(tmp_path)
    before = store.load() or {}
    attrs = settle(tmp_path, "apr-1", outcome)
    assert attrs is not None and attrs["action"] == "write_discarded"
    assert (store.data / "kept.txt").read_text() == "old\n" and not (store.data / "added.txt").exists()
    assert not staged.exists()
    state = store.load() or {}
    assert "pending" not in state and state["manifest_hash"] == before["manifest_hash"]


def test_an_approved_write_over_a_changed_workspace_is_discarded(tmp_path: Path) -> None:
    store, _staged = staged_write(tmp_path)
    state = store.load() or {}
    state["manifest_hash"] = "sha256:something-else"  # another write landed since the copy was staged
    store.store(state)
    attrs = settle(tmp_path, "apr-1", "approved")
    assert attrs is not None and attrs["action"] == "write_discarded" and "changed since" in attrs["reason"]
    assert (store.data / "kept.txt").read_text() == "old\n"


def test_stores_are_listed_and_unknown_approvals_ignored(tmp_path: Path) -> None:
    staged_write(tmp_path)
    host_dir = tmp_path / "hostdir"
    host_dir.mkdir()
    Store(tmp_path, path=host_dir).store({"path": str(host_dir)})
    assert [s.label for s in all_stores(tmp_path)] == ["proj", str(host_dir)]
    assert settle(tmp_path, "apr-other", "approved") is None
