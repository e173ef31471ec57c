"""What `sandbox run` prepares for the workload before any runtime is involved: the environment
(admission's, rewritten for inside the sandbox), the command allow-list, the workspace directory.
Stdlib only (start-up time)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from egressgate.runtimes.admitenv import rewrite_env
from egressgate.runtimes.base import CA_PATH_IN_SANDBOX, SANDBOX_UID, SandboxAddress
from egressgate.runtimes.identity import MIN_UID, chown_tree, is_sandbox_uid

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SetupFailed(RuntimeError):
    """The run cannot start; the message is the one sentence the operator sees."""


def inside_env(admission: dict[str, Any], address: SandboxAddress, proxy_port: int,
               home: str) -> tuple[dict[str, str], Path]:
    """Admission's env rewritten for inside the sandbox (runtimes/admitenv.py: the one rewrite), plus
    PATH/HOME/LANG defaults, and the host path of the CA bundle. The proxy is the host end of the
    sandbox link (the nat rule sends <host_ip>:<proxy port> to the explicit proxy). Nothing from the
    caller's environment is added."""
    admitted = admission.get("env") or {}
    if not admitted.get("HTTP_PROXY"):
        raise SetupFailed("admission returned no HTTP_PROXY; the gateway is too old for `sandbox run`")
    bundle = admitted.get("SSL_CERT_FILE")
    if not bundle:
        raise SetupFailed("admission returned no CA bundle (SSL_CERT_FILE); the gateway publishes none")
    env: dict[str, str] = {"PATH": DEFAULT_PATH, "HOME": home, "LANG": "C.UTF-8"}
    env.update(rewrite_env(admitted, sandbox_id=str(admission["id"]), token=str(admission["token"]),
                           proxy=(address.host_ip, proxy_port), ca_path=CA_PATH_IN_SANDBOX))
    return env, Path(bundle)


def command_allowed(name: str, allowed: list[str]) -> bool:
    """`python` in `execution.commands` also admits `python3` and `python3.12`: a version suffix (digits
    and dots) names the same program, and distributions ship only the versioned name. Nothing else is
    stretched: `python3-config`, `pythonw` or a path that merely ends in an allowed name do not match."""
    for entry in allowed:
        if name == entry:
            return True
        suffix = name.removeprefix(entry)
        if suffix != name and suffix[:1].isdigit() and all(part.isdigit() for part in suffix.split(".")):
            return True
    return False


def check_command(command: tuple[str, ...], execution: dict[str, Any]) -> None:
    """`execution.commands` non-empty: the command's basename must be one of them (see command_allowed)."""
    allowed = execution.get("commands") or []
    if allowed and not command_allowed(os.path.basename(command[0]), allowed):
        raise SetupFailed(f"the policy allows only the commands {', '.join(allowed)} (execution.commands); "
                          f"{os.path.basename(command[0])!r} is not one of them")


def unreachable_parent(path: Path, uid: int = SANDBOX_UID) -> Path | None:
    """The first ancestor of `path` that the run's host uid cannot traverse (bwrap runs as that uid and
    opens the workspace by path), or None."""
    for parent in reversed(path.parents):
        st = parent.stat()
        if st.st_mode & 0o001:
            continue
        if (st.st_uid == uid and st.st_mode & 0o100) or (st.st_gid == uid and st.st_mode & 0o010):
            continue
        return parent
    return None


# directories whose ownership must never change: a --workspace typo must not give /etc to the sandbox uid
SYSTEM_DIRS = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt",
                         "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/var/tmp"})  # noqa: S108 - refused, not used


def check_workspace(path: Path) -> None:
    """Refuse a system directory (after resolving `..` and symlinks) before anything is changed."""
    if str(path.resolve()) in SYSTEM_DIRS:
        raise SetupFailed(f"the workspace {path} is a system directory; give the sandbox a directory of its own")


def sandbox_controlled(path: Path, uid_range: tuple[int, int] | None = None, _depth: int = 0) -> Path | None:
    """The first point where a sandbox uid (any of `uid_range`, or 65534) could have planted or could swap
    part of `path`: a symlink it owns, or any entry of a directory it owns (an earlier run's workspace,
    which a concurrent run may be writing). Every symlink on the way is followed one link at a time (a
    root-made link may lead through a planted one). None when root and the operator alone decide what
    `path` names."""
    if _depth > 40:  # the kernel's own limit (ELOOP)
        return path

    def ours(uid: int) -> bool:
        return is_sandbox_uid(uid, uid_range)

    parent = Path("/")
    for part in path.absolute().parts[1:]:
        entry = parent / part
        try:
            parent_uid, st = os.lstat(parent).st_uid, os.lstat(entry)
        except FileNotFoundError:
            return None
        if ours(parent_uid) or (stat.S_ISLNK(st.st_mode) and ours(st.st_uid)):
            return entry
        if stat.S_ISLNK(st.st_mode):
            found = sandbox_controlled(parent / os.readlink(entry), uid_range, _depth + 1)
            if found is not None:
                return found
            entry = entry.resolve()
        parent = entry
    return None


def resolve_workspace(path: Path, uid_range: tuple[int, int] | None = None) -> Path:
    """The checks of prepare_workspace that change no owner: refused a system directory and a path a sandbox
    could have redirected; created if missing; returns the resolved path. `sandbox run` calls it BEFORE it
    mounts a bounded file system on the workspace (diskfs.py), then prepare_workspace on the mounted one."""
    check_workspace(path)
    planted = sandbox_controlled(path, uid_range)
    if planted is not None:
        raise SetupFailed(f"the workspace {path} goes through {planted}, which a sandbox uid controls; "
                          "give a directory outside earlier workspaces")
    path.mkdir(parents=True, exist_ok=True)
    path = path.resolve()
    check_workspace(path)
    return path


def prepare_workspace(path: Path, uid: int = SANDBOX_UID, uid_range: tuple[int, int] | None = None) -> Path:
    """The workspace must be the run's own: created if missing, and its top directory and every entry an
    earlier sandbox made (owned by a sandbox uid: `uid_range` or 65534) given to the run's host uid/gid
    (runtimes/identity.py: a persistent workspace changes hands at each run's start; files the operator
    placed keep their owners). Returns the resolved path every later step uses. Refused: a system
    directory, and a path a sandbox could have redirected (a symlink it planted in an earlier workspace
    would otherwise make this chown, then bind read-write, e.g. /root/.ssh)."""
    path = resolve_workspace(path, uid_range)
    blocked = unreachable_parent(path, uid)
    if blocked is not None:
        raise SetupFailed(f"the workspace {path} is not reachable by the sandbox uid {uid}: {blocked} "
                          f"has mode {blocked.stat().st_mode & 0o7777:04o} (allow traversal: chmod o+x {blocked})")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:  # by fd: the directory checked is the directory chowned (the top always: the operator's too)
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (uid, uid):
            os.fchown(fd, uid, uid)
    finally:
        os.close(fd)
    chown_tree(path, uid, uid, lambda owner: is_sandbox_uid(owner, uid_range))
    return path


def release_workspace(path: Path, uid: int) -> int:
    """At the end of a run (teardown, its watchdog, `sandbox gc`): the run's files go to root, so a later
    run that is given the same uid (uids are reused after free) cannot read them through any path it
    sees; the next run that uses the workspace takes them over (prepare_workspace). Only entries owned
    by `uid`, and only a sandbox uid (never the host's own), are touched. Returns how many changed."""
    if uid < MIN_UID or not path.is_dir():
        return 0
    return chown_tree(path, 0, 0, lambda owner: owner == uid)
