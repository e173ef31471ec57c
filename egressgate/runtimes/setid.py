"""Set-id files left in a workspace at teardown: strip the bits and report them (issue 20, item 5).

Why: the workspace is a host directory that outlives the run. Inside, the mount is nosuid and seccomp refuses
set-id modes (seccomp.SETID_MODE), but a bit can still arrive from outside the sandbox's syscalls (a host
process, a container runtime's copy, a filesystem that ignores the mount flag); after the run any local user
could execute such a file with the sandbox's identity. So `sandbox run` walks the workspace after the
workload is dead, clears S_ISUID/S_ISGID on regular files, and puts the paths in the revocation's outcome
(`egressgate.run.setid_stripped` in the audit record).

The walk is fdwalk.walk (O_NOFOLLOW from the parent's descriptor: a symlink planted in the workspace cannot
lead it outside; one file system; bounded by MAX_ENTRIES). A
root-owned file with more than one link is left alone: the sandbox cannot make one (hard links across mounts
fail), so it is the host's, and its other name may be a host binary whose bits must stay.
"""

from __future__ import annotations

import os
import stat

from egressgate.runtimes.fdwalk import TooLarge, walk

MAX_ENTRIES = 200_000
MAX_REPORTED = 100  # paths in the outcome (the audit record stays small); `setid_stripped` counts them all
SETID = stat.S_ISUID | stat.S_ISGID


def strip_setid(root: os.PathLike[str] | str) -> list[str]:
    """Clear set-id bits on regular files under `root`; the stripped paths, relative to root. Past
    MAX_ENTRIES entries the walk stops (what it stripped so far is reported)."""
    stripped: list[str] = []
    try:
        for found in walk(root, MAX_ENTRIES):
            st = found.st
            if (stat.S_ISREG(st.st_mode) and st.st_mode & SETID and not (st.st_uid == 0 and st.st_nlink > 1)
                    and _clear(found.dir_fd, found.name)):
                stripped.append(found.path)
    except (OSError, TooLarge):  # OSError: the root cannot be opened (gone, or a symlink): nothing to strip
        pass
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
