"""A persistent `--workspace` under the microvm runtime: copied into the run's workspace image at the start
(`mkfs.ext4 -d`) and back from the guest at a clean end, as a tar the guest's init writes to the port
`eg.out` (the host never mounts a file system the guest wrote: its kernel would parse an image an
exploited guest kernel could have crafted).

The tar is untrusted input. It is spooled to a file of bounded size, extracted with tarfile's `data`
filter (no absolute paths, no `..`, no links leaving the tree or absolute, no devices or fifos, no set-id
bits, owners dropped: every entry is root's, as every runtime leaves a workspace at the end; a refused entry
is left out and named) into a staging directory
inside the workspace, and only then swapped in for the old content. A run that does not end cleanly (killed,
a limit, no status) leaves the workspace as it was before the run.
"""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

STAGING_PREFIX = ".egressgate-staging-"
MKFS_ONLY = "lost+found"  # mkfs.ext4 creates it; not the workload's unless the workspace had one


def limit_for(image_bytes: int) -> int:
    """The most a tar of an image of `image_bytes` may hold (headers and padding included)."""
    return image_bytes * 2 + (16 << 20)


def sync_back(spool: Path, workspace: Path, run_id: str, had_lost_found: bool) -> tuple[int, list[str]]:
    """Replace `workspace`'s content with the tar in `spool`; returns (entries copied, entries the data
    filter refused: left out). Raises tarfile.TarError / OSError (the workspace is then unchanged but for a
    removed staging dir)."""
    staging = workspace / f"{STAGING_PREFIX}{run_id}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=0o700)
    count = 0
    skipped: list[str] = []
    try:
        with tarfile.open(spool, mode="r:") as tar:
            members = []
            for member in tar:
                name = os.path.normpath(member.name)
                top = name.split("/", 1)[0]
                if name == "." or top.startswith(STAGING_PREFIX) or (top == MKFS_ONLY and not had_lost_found):
                    continue
                members.append(member)

            def data_or_skip(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
                try:
                    return tarfile.data_filter(member, dest)
                except tarfile.FilterError:  # e.g. an absolute symlink (a venv's python): left out, named
                    skipped.append(member.name)
                    return None

            tar.extractall(staging, members=members, filter=data_or_skip)  # noqa: S202 - the data filter
            count = len(members) - len(skipped)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for entry in os.listdir(workspace):
        if entry == staging.name:
            continue
        path = workspace / entry
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for entry in os.listdir(staging):
        os.rename(staging / entry, workspace / entry)
    staging.rmdir()
    return count, skipped
