"""What `sandbox run` prepares for the workload before any runtime is involved: the environment
(admission's, rewritten for inside the sandbox), the command allow-list, the workspace directory.
Stdlib only (start-up time)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from egressgate.runtimes.admitenv import rewrite_env
from egressgate.runtimes.base import CA_PATH_IN_SANDBOX, SANDBOX_UID, SandboxAddress

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


def check_command(command: tuple[str, ...], execution: dict[str, Any]) -> None:
    """`execution.commands` non-empty: the command's basename must be one of them (exact match)."""
    allowed = execution.get("commands") or []
    if allowed and os.path.basename(command[0]) not in allowed:
        raise SetupFailed(f"the policy allows only the commands {', '.join(allowed)} (execution.commands); "
                          f"{os.path.basename(command[0])!r} is not one of them")


def unreachable_parent(path: Path) -> Path | None:
    """The first ancestor of `path` that uid 65534 cannot traverse (bwrap runs as that uid and opens
    the workspace by path), or None."""
    for parent in reversed(path.parents):
        st = parent.stat()
        if st.st_mode & 0o001:
            continue
        if (st.st_uid == SANDBOX_UID and st.st_mode & 0o100) or (st.st_gid == SANDBOX_UID and st.st_mode & 0o010):
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


def prepare_workspace(path: Path) -> None:
    """The workspace must be writable by the sandbox uid: created if missing, and its top directory
    given to uid/gid 65534 (files inside keep their owners). A system directory is refused."""
    check_workspace(path)
    path.mkdir(parents=True, exist_ok=True)
    blocked = unreachable_parent(path)
    if blocked is not None:
        raise SetupFailed(f"the workspace {path} is not reachable by the sandbox uid {SANDBOX_UID}: {blocked} "
                          f"has mode {blocked.stat().st_mode & 0o7777:04o} (allow traversal: chmod o+x {blocked})")
    st = path.stat()
    if (st.st_uid, st.st_gid) != (SANDBOX_UID, SANDBOX_UID):
        os.chown(path, SANDBOX_UID, SANDBOX_UID)
