"""Persistent workspaces kept by the runtime (issue 22): `sandbox run --workspace NAME` and `egressgate
workspaces list|show|rm`.

Layout under the var dir (root-owned, 0700, like the rest of it):

    var/workspaces/NAME/            one named workspace
        data/                       its content (or data/.egressgate-workspace.ext4 when max_bytes is set)
        state.json                  0600: the last run's manifest and inventory, policy, sandbox, pending write
        staged/<run_id>/            a run's copy while `persistent_write` needs approval (persist.py)
        .lock                       held (flock) by the run using the workspace and while a write is settled
    var/workspaces/.paths/<hash>/   the same bookkeeping (state.json, .lock) for a host-directory workspace
                                    (`--workspace /some/dir`), whose content stays where the operator put it

Why under the var dir: a workspace's bookkeeping must survive reboots (runtime.state_dir is /run) and be out
of every sandbox's reach (the sandbox writes the workspace, never its manifest). A named workspace's data is
shown to the sandbox through a bind mount on `state_dir/workspaces/<run_id>` (diskfs.DiskLimits.bind): the
var dir stays 0700. Stdlib only.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
PATHS_DIR = ".paths"
RENAME_EXCHANGE = 2


class WorkspaceError(RuntimeError):
    """One sentence for the operator."""


def is_name(value: str) -> bool:
    """`--workspace VALUE` names a runtime-kept workspace when it has no '/' (a path needs one: ./work)."""
    return "/" not in value and NAME_RE.fullmatch(value) is not None and value not in (".", "..")


def root(var_dir: Path) -> Path:
    return var_dir / "workspaces"


class Store:
    """The bookkeeping of one persistent workspace (named, or a host directory)."""

    def __init__(self, var_dir: Path, name: str | None = None, path: Path | None = None) -> None:
        assert (name is None) != (path is None)
        self.var_dir = var_dir
        self.name = name
        self.path = path
        if name is not None:
            if not is_name(name):
                raise WorkspaceError(
                    f"{name!r} is not a workspace name (lowercase letters, digits, '_.-', "
                    "at most 63; a host directory is given as a path: ./dir)"
                )
            self.dir = root(var_dir) / name
            self.data = self.dir / "data"
        else:
            assert path is not None
            self.dir = root(var_dir) / PATHS_DIR / hashlib.sha256(str(path).encode()).hexdigest()[:24]
            self.data = path
        self.state_file = self.dir / "state.json"
        self._lock_fd: int | None = None

    @property
    def label(self) -> str:
        return self.name if self.name is not None else str(self.path)

    def create(self) -> None:
        for d in (self.var_dir, root(self.var_dir), self.dir.parent, self.dir):
            d.mkdir(mode=0o700, exist_ok=True)
        if self.name is not None and not self.data.exists():
            self.data.mkdir(mode=0o700)

    def lock(self, wait: float = 0.0) -> None:
        """Exclusive for one run (or one settlement); WorkspaceError when another holds it past `wait` s."""
        self.create()
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise WorkspaceError(f"the workspace {self.label} is in use by another run") from None
                time.sleep(0.05)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def load(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise WorkspaceError(
                f"the workspace record {self.state_file} is unreadable ({exc}); restore it or remove the workspace"
            ) from None

    def store(self, state: dict[str, Any]) -> None:
        """Atomic (temp file + rename), 0600."""
        self.create()
        tmp = self.state_file.with_name(f".state.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(state, separators=(",", ":")))  # one call: the C encoder (json.dump is Python)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.state_file)

    def staged_dir(self, run_id: str) -> Path:
        """Where a run's staged copy lives: on the data's own file system, so that applying it is one
        rename (exchange). A named workspace's next to its data; a host directory's next to the directory."""
        if self.path is not None:
            return self.path.parent / f".{self.path.name}.egressgate-staged.{run_id}"
        return self.dir / "staged" / run_id

    def stage(self, run_id: str) -> Path:
        """A full copy of the data to run on (persistent_write): modes, links and sparse images as they are."""
        staged = self.staged_dir(run_id)
        staged.parent.mkdir(mode=0o700, exist_ok=True)
        if staged.exists():
            shutil.rmtree(staged)
        res = _cp(self.data, staged)
        if res:
            shutil.rmtree(staged, ignore_errors=True)
            raise WorkspaceError(f"cannot stage a copy of the workspace {self.label}: {res}")
        return staged

    def drop_stale_staged(self) -> None:
        """Copies of runs that ended without a pending write (killed runs): removed (called with no write
        pending, under the lock)."""
        if self.path is not None:
            for child in self.path.parent.glob(f".{self.path.name}.egressgate-staged.*"):
                if child.is_dir() and not child.is_symlink() and child.stat().st_uid == 0:
                    shutil.rmtree(child, ignore_errors=True)
            return
        parent = self.dir / "staged"
        if parent.is_dir():
            for child in parent.iterdir():
                shutil.rmtree(child, ignore_errors=True)


def _cp(src: Path, dst: Path) -> str | None:
    import subprocess

    res = subprocess.run(
        ["cp", "-a", "--sparse=always", "--reflink=auto", "--no-target-directory", str(src), str(dst)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    return None if res.returncode == 0 else (res.stderr or res.stdout).strip()[-300:]


def exchange(a: Path, b: Path) -> None:
    """Swap two directories in one rename (renameat2 RENAME_EXCHANGE): a reader sees the old or the new
    tree, never a mix (the atomic apply of an approved write)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise WorkspaceError(f"cannot swap {a} and {b}: {os.strerror(err)}")


def all_stores(var_dir: Path) -> list[Store]:
    """Every workspace with bookkeeping: named ones, then host directories (from their state.json)."""
    out: list[Store] = []
    base = root(var_dir)
    if not base.is_dir():
        return out
    for child in sorted(base.iterdir()):
        if child.name != PATHS_DIR and is_name(child.name) and child.is_dir():
            out.append(Store(var_dir, name=child.name))
    paths = base / PATHS_DIR
    if paths.is_dir():
        for child in sorted(paths.iterdir()):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                state = json.loads((child / "state.json").read_text(encoding="utf-8"))
                out.append(Store(var_dir, path=Path(state["path"])))
    return out


def find_pending(var_dir: Path, approval_id: str) -> Store | None:
    for store in all_stores(var_dir):
        with contextlib.suppress(WorkspaceError):
            state = store.load() or {}
            if (state.get("pending") or {}).get("approval_id") == approval_id:
                return store
    return None


def settle(var_dir: Path, approval_id: str, outcome: str, by: str | None = None) -> dict[str, Any] | None:
    """The end of a staged write (`outcome`: approved | denied | expired): approved -> the staged copy is
    swapped in atomically and its manifest becomes the workspace's; otherwise the copy is removed. Idempotent
    (a write already settled, or unknown here, returns None); returns the audit attributes of what was done.
    Called by the gateway when the approval is decided or expires, and by `sandbox run` / `egressgate
    workspaces` for a decision the gateway could not apply (another host, no permission)."""
    store = find_pending(var_dir, approval_id)
    if store is None:
        return None
    store.lock(wait=30)
    try:
        state = store.load() or {}
        pending = state.get("pending") or {}
        if pending.get("approval_id") != approval_id:
            return None
        staged = store.staged_dir(str(pending["run_id"]))
        attrs: dict[str, Any] = {
            "name": store.label,
            "approval_id": approval_id,
            "outcome": outcome,
            "changes": int(pending.get("count", 0)),
        }
        if by:
            attrs["by"] = by
        if outcome == "approved":
            if state.get("manifest_hash") != pending.get("base_manifest_hash"):
                attrs.update(action="write_discarded", reason="the workspace changed since the write was staged")
                shutil.rmtree(staged, ignore_errors=True)
            else:
                exchange(store.data, staged)  # staged now holds the old content
                new = {k: v for k, v in state.items() if k != "pending"}
                new.update(pending["next"])
                store.store(new)
                shutil.rmtree(staged, ignore_errors=True)
                attrs.update(
                    action="write_applied",
                    manifest_hash=new.get("manifest_hash"),
                    previous_manifest_hash=pending.get("base_manifest_hash"),
                )
                return attrs
        else:
            shutil.rmtree(staged, ignore_errors=True)
            attrs["action"] = "write_discarded"
        store.store({k: v for k, v in state.items() if k != "pending"})
        return attrs
    finally:
        store.unlock()
