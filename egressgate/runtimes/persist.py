"""Persistence without authority (issue 22, the seed article's `persistence` section): what `sandbox run` does
with a persistent workspace before the workload starts (a restore is a new admission) and after it is dead.

Active for a named workspace (`--workspace NAME`, runtimes/workspaces.py) always, and for a host-directory
workspace when the policy has a `persistence` section.

At the end of a run (teardown: workload dead, files given back to root, image still mounted):
  only `persistence.save` paths (all of the workspace when absent) minus `discard` paths are kept; shell and
  REPL history files and anything that is not a file, directory or symlink are never kept (`shell_history`;
  `process_state` is never kept either: every run is a new process tree, nothing is checkpointed); then the
  manifest (runtimes/manifest.py: sha256 of every kept file) and the dependency inventory (depscan.py) are
  stored in the workspace's record (0600, var dir) and the manifest hash goes into the audit chain (`saved`).
  With `persistent_write` in `execution.require_approval_for`, the run worked on a staged copy: its changes
  become ONE pending approval listing every changed path with size and sha256 (admin/workspaces_api.py);
  approved, the copy is swapped in atomically (workspaces.settle); denied or expired, it is removed.

At the start of the next run (after admission, before the sandbox uid owns anything), the restore checks:
  verify_manifest_hash: the content must be exactly what the last run's manifest says; anything changed
    outside a run refuses the run (exit 120, `restore_refused` record naming what changed) unless the
    operator passes --accept-changes (`changes_accepted`, naming who);
  rescan_dependencies: the inventory now against the last one (`restored` names what was added, removed,
    changed);
  reapply_current_policy (always): the current policy's save/discard selection is applied to the restored
    content, and the record names the previous and the current policy hash;
  reissue_short_lived_credentials (always): the run was admitted anew (new id, token, phantoms); the previous
    run's sandbox is checked revoked at the gateway, and revoked now if it was not (`restored` says which).
The checks themselves are runtimes/restore_checks.py; this module runs the workspace's life cycle around them.
"""

from __future__ import annotations

import getpass
import os
import shutil
import time
from pathlib import Path
from typing import Any

from egressgate.runtimes import depscan, manifest, restore_checks
from egressgate.runtimes.restore_checks import REPORTED
from egressgate.runtimes.workload import SetupFailed
from egressgate.runtimes.workspaces import Store, WorkspaceError, settle


def log(message: str) -> None:
    import sys

    print(f"egressgate: {message}", file=sys.stderr, flush=True)


class Persist:
    def __init__(self, run: Any, policy: dict[str, Any], admission: dict[str, Any]) -> None:
        self.run = run
        self.section: dict[str, Any] = policy.get("persistence") or {}
        self.ws_path = str(((policy.get("sandbox") or {}).get("workspace") or {}).get("path") or "/workspace")
        kinds = (policy.get("execution") or {}).get("require_approval_for") or []
        self.needs_approval = "persistent_write" in kinds
        self.checks = set(self.section.get("restore_checks") or [])
        self.policy_name = str(admission.get("policy") or run.req.policy)
        self.policy_hash = admission.get("policy_hash")
        self.store: Store | None = None
        self.state: dict[str, Any] = {}
        self.staged: Path | None = None
        self.content: Path | None = None  # the host directory holding the content while mounted
        self.restored = False
        self.kept_staged = False  # the staged copy waits for an approval (finish leaves it)
        self.restore_inventory: dict[str, str] | None = None  # rescan_dependencies: the inventory at restore

    # ------------------------------------------------------------------------------ helpers
    def _save_discard(self) -> tuple[list[str] | None, list[str]]:
        save = manifest.relative(self.section.get("save"), self.ws_path)
        discard = manifest.relative([d for d in self.section.get("discard") or []], self.ws_path) or []
        return save, discard

    def record(
        self,
        action: str,
        decision: str,
        attributes: dict[str, Any],
        reason: str | None = None,
        message: str | None = None,
    ) -> None:
        """One `workspace` audit record through the gateway; SetupFailed when it cannot be written."""
        assert self.store is not None
        body = {
            "action": action,
            "workspace": self.store.label,
            "sandbox_id": self.run.sandbox_id,
            "policy": self.policy_name,
            "policy_hash": self.policy_hash,
            "decision": decision,
            "attributes": {k: v for k, v in attributes.items() if v is not None},
        }
        if reason:
            body.update(reason=reason, message=message)
        status, data = self.run._admin("POST", "/v1/workspaces/records", body)
        if status != 200:
            raise SetupFailed(f"the workspace record could not be written ({status}): {data.get('message')}")

    # ------------------------------------------------------------------------------ start
    def open(self, name: str | None, path: Path | None) -> Path:
        """Lock the workspace, settle a decided write, stage a copy when writes need approval; returns the
        host directory the run uses as its workspace (before any mount)."""
        try:
            self.store = store = Store(self.run.req.var_dir.absolute(), name=name, path=path)
            store.lock()
            self.state = store.load() or {}
        except WorkspaceError as exc:
            raise SetupFailed(str(exc)) from None
        pending = self.state.get("pending")
        if pending:
            self._settle_pending(str(pending["approval_id"]))
        store.drop_stale_staged()
        if self.needs_approval:
            try:
                self.staged = store.stage(self.run.run_id)
            except WorkspaceError as exc:
                raise SetupFailed(str(exc)) from None
            return self.staged
        if store.name is not None:
            store.create()
        return store.data

    def _settle_pending(self, approval_id: str) -> None:
        assert self.store is not None
        status, data = self.run._admin("GET", f"/v1/approvals/{approval_id}", None)
        state = data.get("state") if status == 200 else ("expired" if status == 404 else None)
        if state == "pending":
            raise SetupFailed(
                f"the workspace {self.store.label} has a write waiting for approval {approval_id}; "
                f"approve or deny it first (egressgate approvals approve|deny {approval_id})"
            )
        if state not in ("approved", "denied", "expired"):
            raise SetupFailed(f"the state of approval {approval_id} is unknown ({status}); retry")
        self.store.unlock()  # settle takes the lock itself
        try:
            attrs = settle(self.run.req.var_dir.absolute(), approval_id, state, data.get("decided_by"))
            self.store.lock()
            self.state = self.store.load() or {}
        except WorkspaceError as exc:
            raise SetupFailed(str(exc)) from None
        if attrs is not None:
            action = attrs.pop("action")
            self.record(action, "allow" if action == "write_applied" else "deny", attrs)

    def expose(self, disks: Any, state_dir: Path, data: Path) -> Path:
        """A named workspace's data bound on state_dir/workspaces/<run_id>, a path the run's uid can traverse
        (the var dir stays 0700); the mount is DiskLimits', released with them."""
        from egressgate.runtimes.diskfs import DiskLimitError

        (state_dir / "workspaces").mkdir(mode=0o711, exist_ok=True)
        state_dir.chmod(0o711)  # traversable (not listable) by the sandbox uid; records stay 0700
        target = state_dir / "workspaces" / self.run.run_id
        try:
            disks.bind(data, target)
        except DiskLimitError as exc:
            raise SetupFailed(str(exc)) from None
        return target

    def restore(self, content: Path) -> None:
        """The restore checks on the content as the last run left it (root-owned, not yet the run's)."""
        assert self.store is not None
        self.content = content
        try:
            entries = manifest.scan(content)
        except (OSError, manifest.TooLarge) as exc:
            raise SetupFailed(f"cannot read the workspace {self.store.label}: {exc}") from None
        entries = restore_checks.own_entries(entries)
        prev = self.state
        attrs: dict[str, Any] = {"first_run": not prev.get("manifest_hash"), "checks": sorted(self.checks) or None}
        if "verify_manifest_hash" in self.checks:
            self._verify(prev, entries, attrs)
        save, discard = self._save_discard()
        gone = manifest.to_remove(entries, save, discard)
        if gone:
            manifest.remove(content, gone)
            entries = manifest.kept(entries, gone)
            attrs.update(removed_at_restore=gone[:REPORTED], removed_at_restore_count=len(gone))
        attrs.update(
            previous_policy=prev.get("policy"),
            previous_policy_hash=prev.get("policy_hash"),
            policy_hash=self.policy_hash,
            policy_changed=bool(prev.get("policy_hash")) and prev.get("policy_hash") != self.policy_hash,
        )
        if "rescan_dependencies" in self.checks:
            self.restore_inventory = restore_checks.rescan_dependencies(prev, entries, content, attrs)
        attrs.update(restore_checks.reissue(self.run._admin, prev.get("sandbox_id"), self.run.sandbox_id))
        attrs.update(manifest_hash=manifest.manifest_hash(entries), entries=len(entries))
        # what earlier runs saved (root's since their end) is this run's again: only paths the previous manifest
        # lists and that are still there; what an operator placed or accepted keeps its owner
        saved = set(prev.get("entries") or {}) & set(entries)
        attrs["taken_over"] = restore_checks.take_over(content, saved, self.run.uid) if saved and self.run.uid else 0
        self.record("restored", "allow", attrs)
        self.restored = True

    def _verify(self, prev: dict[str, Any], entries: dict[str, manifest.Entry], attrs: dict[str, Any]) -> None:
        """verify_manifest_hash: unchanged content passes; a change is refused, or accepted by the operator."""
        assert self.store is not None
        changed = restore_checks.manifest_changes(prev, entries)
        if changed is None:
            attrs["verified"] = True
            return
        d, what = changed
        where = "since its last run" if prev.get("manifest_hash") else "and has no manifest from an earlier run"
        if self.run.req.accept_changes:
            who = os.environ.get("SUDO_USER") or getpass.getuser()
            self.record("changes_accepted", "allow", {**what, "accepted_by": who})
            log(
                f"the workspace {self.store.label} changed outside a run ({d.summary()}); accepted by {who} "
                "(--accept-changes)"
            )
            attrs["verified"] = False
            return
        message = (
            f"The workspace {self.store.label} was changed outside a run {where} ({d.summary()}); an operator "
            "who trusts the change reruns with --accept-changes."
        )
        self.record("restore_refused", "deny", what, reason="workspace_changed", message=message)
        raise SetupFailed(message)

    # ------------------------------------------------------------------------------ end
    def save(self, started: bool) -> None:
        """Teardown: keep the selection, write the manifest (or stage the changes for approval)."""
        if self.store is None:
            return
        if not (self.restored and self.content is not None) or (self.staged is not None and not started):
            return  # nothing restored, or a staged copy nothing ran on (finish removes it after the unmount)
        # (restored but never started: the manifest of what the restore left, so the next restore verifies)
        content = self.content
        entries = restore_checks.own_entries(manifest.scan(content))
        save, discard = self._save_discard()
        gone = manifest.to_remove(entries, save, discard)
        manifest.remove(content, gone)
        entries = manifest.kept(entries, gone)
        state = {
            "manifest_hash": manifest.manifest_hash(entries),
            "entries": entries,
            "inventory": depscan.inventory(entries, restore_checks.reader(content)),
            "policy": self.policy_name,
            "policy_hash": self.policy_hash,
            "sandbox_id": self.run.sandbox_id,
            "run_id": self.run.run_id,
            "saved_at": time.time(),
            "name": self.store.name,
            "path": str(self.store.path) if self.store.path else None,
            "created": self.state.get("created") or time.time(),
            "restore_inventory": self.restore_inventory,
        }
        attrs = {
            "manifest_hash": state["manifest_hash"],
            "entries": len(entries),
            "removed": gone[:REPORTED],
            "removed_count": len(gone),
            "previous_manifest_hash": self.state.get("manifest_hash"),
        }
        if self.staged is not None:
            self._stage_write(state, attrs)
            return
        self.store.store(state)
        self.record("saved", "allow", attrs)
        log(
            f"workspace {self.store.label} saved: {len(entries)} entries, manifest {state['manifest_hash']}"
            + (f"; dropped {len(gone)} path(s) not saved by the policy" if gone else "")
        )

    def _stage_write(self, state: dict[str, Any], attrs: dict[str, Any]) -> None:
        assert self.store is not None and self.staged is not None
        base = self.state.get("entries") or {}
        d = manifest.diff(base, state["entries"])
        meta = {k: state[k] for k in ("policy", "policy_hash", "sandbox_id", "run_id")}
        if d.empty():
            self.store.store({**self.state, **meta} if self.state.get("manifest_hash") else state)
            self.record("saved", "allow", {**attrs, "unchanged": True})
            log(f"workspace {self.store.label}: the run changed nothing; no write to approve")
            return  # the staged copy is removed after it is unmounted (discard_staged)
        listed = []
        for action, paths, source in (
            ("added", d.added, state["entries"]),
            ("changed", d.changed, state["entries"]),
            ("removed", d.removed, base),
        ):
            for p in paths:
                e = source[p]
                listed.append(
                    {
                        "path": p,
                        "action": action,
                        "type": e.get("t"),
                        "size": e.get("size") if action != "removed" else None,
                        "sha256": e.get("sha256") if action != "removed" else None,
                    }
                )
        body = {
            "sandbox_id": self.run.sandbox_id,
            "workspace": self.store.label,
            "changes": listed,
            "manifest_hash": state["manifest_hash"],
            "base_manifest_hash": self.state.get("manifest_hash") or "none",
        }
        if self.run.req.approval_ttl:
            body["pending_ttl_seconds"] = self.run.req.approval_ttl
        status, data = self.run._admin("POST", "/v1/workspaces/writes", body)
        if status != 201:
            raise SetupFailed(
                f"the run's workspace changes could not be staged for approval ({status}: "
                f"{data.get('message')}); they are discarded"
            )
        pending = {
            "approval_id": data["id"],
            "run_id": self.run.run_id,
            "count": len(listed),
            "base_manifest_hash": self.state.get("manifest_hash"),
            "next": state,
        }
        base_state = self.state or {"name": self.store.name, "path": state["path"], "created": state["created"]}
        self.store.store({**base_state, **meta, "pending": pending})
        self.kept_staged = True
        log(
            f"workspace {self.store.label}: {len(listed)} change(s) wait for approval {data['id']} "
            f"(egressgate approvals show {data['id']})"
        )

    def finish(self) -> None:
        """After the unmounts: a staged copy nobody waits for is removed; the workspace lock is released."""
        if self.store is None:
            return
        if self.staged is not None and not self.kept_staged:
            shutil.rmtree(self.staged, ignore_errors=True)
        self.store.unlock()
