"""Set-id files left in a workspace at teardown: strip the bits and report them (issue 20, item 5).

Why: the workspace is a host directory that outlives the run. Inside, the mount is nosuid and seccomp refuses
set-id modes (seccomp.SETID_MODE), but a bit can still arrive from outside the sandbox's syscalls (a host
process, a container runtime's copy, a filesystem that ignores the mount flag); after the run any local user
could execute such a file with the sandbox's identity. So `sandbox run` walks the workspace after the
workload is dead, clears S_ISUID/S_ISGID on regular files, and puts the paths in the revocation's outcome
(`egressgate.run.setid_stripped` in the audit record).

The walk opens every directory relative to its parent's descriptor with O_NOFOLLOW (a symlink planted in the
workspace cannot lead it outside), stays on the workspace's filesystem and is bounded (MAX_ENTRIES). A
root-owned file with more than one link is left alone: the sandbox cannot make one (hard links across mounts
fail), so it is the host's, and its other name may be a host binary whose bits must stay.
"""

from __future__ import annotations

import contextlib
import os
import stat

MAX_ENTRIES = 200_000
MAX_REPORTED = 100  # paths in the outcome (the audit record stays small); `setid_stripped` counts them all
SETID = stat.S_ISUID | stat.S_ISGID
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def strip_setid(root: os.PathLike[str] | str) -> list[str]:
    """Clear set-id bits on regular files under `root`; the stripped paths, relative to root."""
    stripped: list[str] = []
    try:
        top = os.open(root, DIR_FLAGS)
    except OSError:
        return stripped
    dev = os.fstat(top).st_dev
    stack: list[tuple[int, str]] = [(top, "")]
    seen = 0
    while stack:
        dfd, rel = stack.pop()
        try:
            names = os.listdir(dfd)
        except OSError:
            names = []
        for name in names:
            seen += 1
            if seen > MAX_ENTRIES:
                break
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            path = f"{rel}/{name}" if rel else name
            if stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                with contextlib.suppress(OSError):
                    stack.append((os.open(name, DIR_FLAGS, dir_fd=dfd), path))
            elif (stat.S_ISREG(st.st_mode) and st.st_mode & SETID and not (st.st_uid == 0 and st.st_nlink > 1)
                  and _clear(dfd, name)):
                stripped.append(path)
        os.close(dfd)
    return stripped


def _clear(dfd: int, name: str) -> bool:
    """fchmod on a descriptor of the very file that was checked (O_NOFOLLOW, still a regular file)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~SETID)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
