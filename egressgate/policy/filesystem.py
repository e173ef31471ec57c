"""Static checks of the `filesystem` section at load, so a policy no runtime can honour is refused before
any sandbox starts (DESIGN: no policy key is silently ignored).

`filesystem.allow` entries name host paths a runtime binds into the sandbox (netns: runtimes/sandbox_fs.py;
docker and gVisor refuse host paths at start), except the workspace path and /tmp, which name the sandbox's
own workspace and private /tmp: always present and always read-write, so an entry for them must say so.
What is refused here, and why:
* a relative or non-normalized path (it would be bound somewhere else than written);
* an entry that grants neither read nor write, or write without read (a mount cannot be write-only);
* a path below the workspace path or /tmp (those trees are the sandbox's own, never host binds);
* `/` and the kernel/runtime trees /proc, /sys, /dev, /run, /var/run (the allowlist would be void, or the
  entry is a host socket or device tree, which a sandbox never gets; sockets and devices elsewhere are
  found when the run starts).
"""

from __future__ import annotations

import posixpath

from egressgate.policy.model import Policy

OWN_TMP = "/tmp"  # noqa: S108 - the sandbox's private /tmp, not a host path
HOST_ONLY = ("/proc", "/sys", "/dev", "/run", "/var/run")


def _under(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


def filesystem_problems(model: Policy) -> list[tuple[str, str]]:
    """(key path, message) for every `filesystem.allow` entry no runtime may honour as written."""
    problems: list[tuple[str, str]] = []
    ws = model.sandbox.workspace.path if model.sandbox.workspace else None
    own = [p for p in (ws and posixpath.normpath(ws), OWN_TMP) if p]
    for i, entry in enumerate(model.filesystem.allow):
        key, path = f"filesystem.allow[{i}]", entry.path
        if not path.startswith("/") or posixpath.normpath(path) != (path.rstrip("/") or "/") or "//" in path:
            problems.append((f"{key}.path", f"{path!r}: an absolute, normalized path (no '.', '..' or '//')"))
            continue
        path = posixpath.normpath(path)
        if not entry.read:
            problems.append((key, "read: true is required (a path is given read-only, or read-write with "
                                  "write: true; an entry granting nothing would be ignored)"))
        if path in own and not entry.write:
            problems.append((key, f"{path} is the sandbox's own {'workspace' if path != OWN_TMP else 'tmp dir'}, "
                                  "always read-write: write: true"))
        if any(_under(path, root) for root in own):
            problems.append((f"{key}.path", f"{path} is inside the sandbox's own workspace or /tmp, not a host "
                                            "path to bind"))
        if path == "/" or any(path == r or _under(path, r) for r in HOST_ONLY):
            problems.append((f"{key}.path", f"{path}: the host root and /proc, /sys, /dev, /run are never "
                                            "given to a sandbox (sockets, devices, kernel state)"))
    return problems
