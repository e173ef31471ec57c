"""The workspace manifest (runtimes/manifest.py): what is recorded, what differs, what the save/discard
selection removes, and that removal never follows a symlink out of the workspace. Real files."""

from __future__ import annotations

import os
from pathlib import Path

from egressgate.runtimes import manifest
from egressgate.runtimes.manifest import diff, kept, manifest_hash, relative, remove, scan, to_remove


def tree(root: Path) -> None:
    (root / "src").mkdir()
    (root / "src" / "app.py").write_text("print(1)\n")
    (root / "src" / ".credentials").write_text("token\n")
    (root / "results").mkdir()
    (root / "results" / "out.csv").write_text("a,b\n")
    (root / "scratch.txt").write_text("junk\n")
    (root / ".bash_history").write_text("curl evil\n")
    (root / "src" / "link").symlink_to("/etc/passwd")


def test_scan_records_files_dirs_and_links_without_following(tmp_path: Path) -> None:
    tree(tmp_path)
    entries = scan(tmp_path)
    assert entries["src"]["t"] == "d"
    app = entries["src/app.py"]
    assert app["t"] == "f" and app["size"] == 9 and len(str(app["sha256"])) == 64
    assert entries["src/link"] == {"t": "l", "target": "/etc/passwd"}


def test_a_changed_byte_mode_or_new_file_changes_the_hash_and_the_diff_names_it(tmp_path: Path) -> None:
    tree(tmp_path)
    before = scan(tmp_path)
    assert manifest_hash(scan(tmp_path)) == manifest_hash(before)  # positive control: stable
    (tmp_path / "src" / "app.py").write_text("print(2)\n")
    (tmp_path / "results" / "new").write_text("x")
    os.chmod(tmp_path / "results" / "out.csv", 0o700)
    (tmp_path / "scratch.txt").unlink()
    after = scan(tmp_path)
    assert manifest_hash(after) != manifest_hash(before)
    d = diff(before, after)
    assert d.added == ["results/new"]
    assert d.removed == ["scratch.txt"]
    assert d.changed == ["results/out.csv", "src/app.py"]
    assert diff(before, before).empty()


def test_selection_keeps_save_minus_discard_and_never_history(tmp_path: Path) -> None:
    tree(tmp_path)
    entries = scan(tmp_path)
    save = relative(["/workspace/src", "/workspace/results"], "/workspace")
    discard = relative(["/tmp", "/workspace/src/.credentials"], "/workspace")
    assert discard == ["src/.credentials"]
    gone = to_remove(entries, save, discard)
    assert gone == [".bash_history", "scratch.txt", "src/.credentials"]
    remove(tmp_path, gone)
    left = scan(tmp_path)
    assert left == kept(entries, gone)
    assert sorted(left) == ["results", "results/out.csv", "src", "src/app.py", "src/link"]


def test_positive_control_without_save_everything_but_discard_and_history_stays(tmp_path: Path) -> None:
    tree(tmp_path)
    gone = to_remove(scan(tmp_path), None, [])
    assert gone == [".bash_history"]


def test_a_saved_path_deep_in_a_tree_keeps_its_parents_only(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "keep").write_text("1")
    (tmp_path / "a" / "other").write_text("2")
    gone = to_remove(scan(tmp_path), ["a/b"], [])
    assert gone == ["a/other"]


def test_removal_does_not_follow_a_symlinked_parent(tmp_path: Path) -> None:
    """A workload replaces a directory by a link to a host directory: deleting `dir/file` must not delete
    the host's file."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("host data")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "dir").symlink_to(outside)
    remove(ws, ["dir/victim"])
    assert (outside / "victim").read_text() == "host data"
    remove(ws, ["dir"])  # the link itself goes, the target stays
    assert not (ws / "dir").exists() and (outside / "victim").exists()


def test_special_files_are_never_kept(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "f").write_text("x")
    assert to_remove(scan(tmp_path), None, []) == ["pipe"]


def test_the_walk_is_bounded(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / str(i)).write_text("x")
    try:
        scan(tmp_path, limit=3)
    except manifest.TooLarge:
        return
    raise AssertionError("a tree over the limit was scanned")


def test_the_documented_recomputation_gives_the_manifest_hash(tmp_path: Path) -> None:
    """docs/policy.md tells an auditor how to recompute the hash from `workspaces show --files`."""
    import hashlib
    import json

    tree(tmp_path)
    entries = json.loads(json.dumps(scan(tmp_path)))  # as the record and the CLI carry it
    h = hashlib.sha256()
    for path in sorted(entries):
        h.update(json.dumps([path, entries[path]], sort_keys=True, separators=(",", ":")).encode() + b"\n")
    assert manifest_hash(scan(tmp_path)) == "sha256:" + h.hexdigest()
