"""The restore checks of a persistent workspace (policy `persistence.restore_checks`, runtimes/persist.py).

What `sandbox run` checks on the content the last run left before the new sandbox's uid owns anything:
whether it is exactly what the last manifest says (verify_manifest_hash), what changed in its dependency
inventory (rescan_dependencies), that the previous run's sandbox is dead (reissue_short_lived_credentials:
the new run was admitted anew), and which entries the new run takes over. Each check returns what the
`restored` / `restore_refused` records say; persist.py decides, records and refuses.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from egressgate.runtimes import depscan, manifest
from egressgate.runtimes.workload import SetupFailed

REPORTED = 20  # paths per list in an audit record (counts are complete)

Admin = Callable[[str, str, dict[str, Any] | None], tuple[int, dict[str, Any]]]


def own_entries(entries: dict[str, manifest.Entry]) -> dict[str, manifest.Entry]:
    """The workload's content: not the image file of a bounded workspace (diskfs.IMAGE, when the directory is
    looked at unmounted) nor the ext4 root's `lost+found` (made by mke2fs, root's, 0700)."""
    return {
        p: e
        for p, e in entries.items()
        if not (p.startswith(".egressgate-workspace.ext4") or p == "lost+found" or p.startswith("lost+found/"))
    }


def take_over(root: Path, paths: set[str], uid: int) -> int:
    """chown to the run's uid every root-owned entry of `root` whose relative path is in `paths` (walked by
    directory fds, no symlink followed; a link is chowned itself). Returns how many changed."""
    changed = 0
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel_dir, dirs, files, dfd in os.fwalk(".", follow_symlinks=False, dir_fd=top):
            base = "" if rel_dir == "." else rel_dir[2:] + "/"
            for name in (*dirs, *files):
                if base + name not in paths:
                    continue
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if st.st_uid == 0:
                        os.chown(name, uid, uid, dir_fd=dfd, follow_symlinks=False)
                        changed += 1
                except FileNotFoundError:
                    continue
    finally:
        os.close(top)
    return changed


def manifest_changes(
    prev: dict[str, Any], entries: dict[str, manifest.Entry]
) -> tuple[manifest.Diff, dict[str, Any]] | None:
    """verify_manifest_hash: None when the content is exactly what the last run's manifest lists; else the
    difference and what the record says of it (paths capped at REPORTED per list, counts complete)."""
    d = manifest.diff(prev.get("entries") or {}, entries)
    if d.empty():
        return None
    return d, {
        "added": d.added[:REPORTED],
        "removed": d.removed[:REPORTED],
        "changed": d.changed[:REPORTED],
        "added_count": len(d.added),
        "removed_count": len(d.removed),
        "changed_count": len(d.changed),
        "previous_manifest_hash": prev.get("manifest_hash"),
        "found_manifest_hash": manifest.manifest_hash(entries),
    }


def rescan_dependencies(
    prev: dict[str, Any], entries: dict[str, manifest.Entry], content: Path, attrs: dict[str, Any]
) -> dict[str, str]:
    """rescan_dependencies: the inventory now against the one the previous run started with (what that run,
    or anything since, changed), summarized into `attrs`; returns the inventory now."""
    inventory = depscan.inventory(entries, reader(content))
    before = prev.get("restore_inventory", prev.get("inventory")) or {}
    change = depscan.summary(depscan.inventory_diff(before, inventory))
    attrs.update({f"deps.{k}": v for k, v in change.items()})
    attrs["deps.count"] = len(inventory)
    return inventory


def reissue(admin: Admin, previous: str | None, current: str | None) -> dict[str, Any]:
    """reissue_short_lived_credentials: the previous run's sandbox (its token, phantoms) must be dead before
    this one works: revoked now if the gateway still has it admitted (SetupFailed when that fails)."""
    attrs: dict[str, Any] = {"sandbox_id": current}
    if not previous:
        return attrs
    attrs["previous_sandbox"] = previous
    status, data = admin("GET", f"/v1/sandboxes/{previous}", None)
    if status == 200 and not data.get("revoked"):
        status, data = admin("DELETE", f"/v1/sandboxes/{previous}", None)
        if status != 200:
            raise SetupFailed(
                f"the previous run's sandbox {previous} is still admitted and could not be revoked "
                f"({status}); refusing to restore its workspace"
            )
        attrs["previous_sandbox_revoked_now"] = True
    else:
        attrs["previous_sandbox_revoked"] = status == 200 or status == 404
    return attrs


def reader(content: Path) -> Callable[[str], bytes | None]:
    """Read a workspace file for the dependency scan (no symlink followed, at most a package.json's size)."""

    def read(rel: str) -> bytes | None:
        try:
            fd = os.open(content / rel, manifest.FILE_FLAGS)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as fh:
            return fh.read(depscan.MAX_PACKAGE_JSON)

    return read
