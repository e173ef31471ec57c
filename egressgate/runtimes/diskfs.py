"""`sandbox.workspace.max_bytes` and `sandbox.tmp.max_bytes` enforced by the kernel: size-bounded file systems.

Why not a watcher: a watcher of apparent sizes misses what the kernel allocates without growing st_size
(fallocate KEEP_SIZE, an unlinked file held open, inode floods) and only acts after the fact. A file system
of a fixed size makes every allocated block and inode count, and the workload gets ENOSPC at the limit.

* Temporary workspace (no --workspace): a tmpfs mounted by `sandbox run` (as root, before the sandbox starts)
  on `state_dir/workspaces/<run_id>`, `size=max_bytes`, `nr_inodes` bounded, `nosuid,nodev`, owned by the
  run's own uid/gid (RunSpec.uid, runtimes/identity.py). The cheap path (one mount(2), no disk I/O). Its
  pages are memory: charged to the writer's memory cgroup.
* Persistent workspace (--workspace DIR): an ext4 image `DIR/.egressgate-workspace.ext4` of exactly max_bytes
  (the host never holds more than that for it), loop-mounted on DIR for the duration of the run only. The
  workspace's content lives in the image; DIR itself holds only the image between runs (root-owned, so no
  local user can swap it). The image's root and what earlier runs made in it change hands like any
  persistent workspace's (workload.prepare_workspace at start, release_workspace and the set-id strip at
  the end), on the MOUNTED content: after the mount, before the unmount. Created on the first bounded run
  from what DIR held (`mke2fs -d`: fifos, devices and symlinks are copied as such, never opened or
  followed), which is then removed from DIR.
* The sandbox's /tmp (netns runtime): a tmpfs like the temporary workspace (mode 1777, owned by the run's
  uid/gid), on `state_dir/tmp/<run_id>`, bound into the sandbox's allowlist root (sandbox_fs.py); docker
  and gVisor get `--tmpfs /tmp:size=...,nr_inodes=...` (tmpfs_options).

Every mount is named in the run record before it exists (`disk_mounts`), so the watchdog or `sandbox gc`
unmounts it after a SIGKILL; image mounts use loop devices with autoclear (freed by the unmount), and gc
also detaches any loop device still backed by a recorded image.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from egressgate.runtimes import records

MiB = 1024 * 1024
DEFAULT_TMP_MAX_BYTES = 256 * MiB  # sandbox.tmp.max_bytes when the policy does not set it
IMAGE = ".egressgate-workspace.ext4"
BYTES_PER_INODE = 4096  # inodes per byte of limit (an inode flood is bounded like the bytes)
MIN_INODES = 1024
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2
MS_REMOUNT, MS_BIND, MS_REC, MS_RELATIME = 32, 4096, 16384, 1 << 21
KEEP_FLAGS = os.ST_RDONLY | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME  # same bits as their MS_ flags
ST_RELATIME = 4096
RELEASE_WAIT = 60.0  # s a previous run's image may take to be let go by its container's namespace (wait_released)
SOURCE_RE = re.compile(r"^egressgate-(ws|tmp)-([0-9a-f]{10})$")
RUN_ID_RE = re.compile(r"^[0-9a-f]{10}$")


class DiskLimitError(RuntimeError):
    """A bounded file system could not be set up: the run must not start without it."""


def full_slack(size: int, block: int) -> int:
    """Free bytes under which a bounded workspace counts as full: min(2 MiB, max(16 blocks, size / 32)).
    Why not 0: ext4 refuses a write that needs a whole (large) folio while blocks are still free (a 2 MiB
    image refused a 64 KiB write with 54 KiB free; folios go up to 2 MiB), so "full" must allow for that."""
    return min(2 * MiB, max(16 * block, size // 32))


def nr_inodes(max_bytes: int) -> int:
    return max(MIN_INODES, max_bytes // BYTES_PER_INODE)


def tmpfs_options(max_bytes: int) -> str:
    """Options of a bounded tmpfs (also docker's `Tmpfs` value): size and inode count, nosuid/nodev."""
    return f"rw,nosuid,nodev,size={max_bytes},nr_inodes={nr_inodes(max_bytes)}"


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_tmpfs(target: Path, source: str, max_bytes: int, uid: int, gid: int, mode: int) -> None:
    opts = f"size={max_bytes},nr_inodes={nr_inodes(max_bytes)},mode={mode:o},uid={uid},gid={gid}"
    if _libc().mount(source.encode(), os.fsencode(target), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise DiskLimitError(f"mount tmpfs on {target} failed: {os.strerror(err)}")


def mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, source) of this mount namespace, in mount order (octal escapes decoded)."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            point, (fstype, source) = left.split()[4], right.split()[:2]
            out.append(tuple(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), s)
                             for s in (point, fstype, source)))
    return out  # type: ignore[return-value]


def mounted(target: Path) -> tuple[str, str] | None:
    """(fstype, source) of the topmost mount at target, or None."""
    found = None
    for point, fstype, source in mounts():
        if point == str(target):
            found = (fstype, source)
    return found


def unmount(target: Path) -> bool:
    libc = _libc()
    if libc.umount2(os.fsencode(target), 0) == 0:
        return True
    return libc.umount2(os.fsencode(target), MNT_DETACH) == 0  # busy: detach now, freed when unused


def loops_of(image: Path) -> list[str]:
    """/dev/loopN devices backed by `image` (sysfs; no process)."""
    out = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if backing.read_text().strip() in (str(image), f"{image} (deleted)"):
                out.append(f"/dev/{backing.parent.parent.name}")
    return out


def _run(argv: list[str]) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    if res.returncode != 0:
        raise DiskLimitError(f"{argv[0]} failed: {(res.stderr or res.stdout).strip()[-300:]}")


class DiskLimits:
    """The bounded file systems of one run (made in setup, removed by release; each step idempotent)."""

    def __init__(self, run_id: str, state_dir: Path) -> None:
        self.run_id = run_id
        self.state_dir = state_dir
        self.made: list[dict[str, str | None]] = []
        self.workspace_mount: Path | None = None

    def _record(self, entry: dict[str, str | None]) -> None:
        """Named in the run record BEFORE the mount exists (gc must find it after a SIGKILL at any point)."""
        self.made.append(entry)
        records.update(self.state_dir, self.run_id, disk_mounts=self.made)

    def temporary_workspace(self, path: Path, max_bytes: int, uid: int) -> None:
        source = f"egressgate-ws-{self.run_id}"
        self._record({"target": str(path), "source": source, "image": None})
        mount_tmpfs(path, source, max_bytes, uid, uid, 0o700)
        self.workspace_mount = path

    def tmp(self, max_bytes: int, uid: int, gid: int) -> Path:
        """A bounded /tmp for the sandbox (mode 1777 like any /tmp, owned by the run's uid/gid); returns its
        host directory."""
        parent = self.state_dir / "tmp"
        parent.mkdir(mode=0o711, exist_ok=True)
        path = parent / self.run_id
        path.mkdir(mode=0o700)
        source = f"egressgate-tmp-{self.run_id}"
        self._record({"target": str(path), "source": source, "image": None})
        mount_tmpfs(path, source, max_bytes, uid, gid, 0o1777)
        return path

    def bind(self, source: Path, target: Path) -> None:
        """A named workspace's data (under the 0700 var dir) shown at `target` = state_dir/workspaces/<run_id>
        (runtimes/workspaces.py), nosuid,nodev; recorded first like every mount."""
        target.mkdir(mode=0o700)
        self._record({"target": str(target), "source": None, "image": None, "bind": str(source)})
        if _libc().mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None) != 0:
            err = ctypes.get_errno()
            raise DiskLimitError(f"bind mount of the workspace {source} on {target} failed: {os.strerror(err)}")
        flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV
        if _libc().mount(None, os.fsencode(target), None, flags, None) != 0:
            err = ctypes.get_errno()
            raise DiskLimitError(f"remount of the workspace {target} nosuid,nodev failed: {os.strerror(err)}")

    def nosuid_bind(self, source: Path) -> Path:
        """A `nosuid,nodev` bind of `source` at `state_dir/binds/<run_id>/<n>`; returns that path. For the
        container runtimes: Docker's bind mounts take no such options, but a bind inherits the flags of the
        mount it copies, so the container's read-write bind of this one is nosuid,nodev too (the bounded
        workspaces are such mounts already). The source mount's other flags (ro, noexec, atime) are kept."""
        parent = self.state_dir / "binds" / self.run_id
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.state_dir / "binds").chmod(0o700)
        target = parent / str(len(self.made))
        if source.is_dir():
            target.mkdir(mode=0o700, exist_ok=True)
        else:  # a file is bound on a file
            target.touch(mode=0o600, exist_ok=True)
        self._record({"target": str(target), "source": None, "image": None, "bind": str(source)})
        keep = os.statvfs(source).f_flag & KEEP_FLAGS
        keep |= MS_RELATIME if os.statvfs(source).f_flag & ST_RELATIME else 0
        libc = _libc()
        for flags, what in ((MS_BIND | MS_REC, "bind"), (MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | keep,
                                                         "remount nosuid,nodev")):
            src = os.fsencode(source) if what == "bind" else None
            if libc.mount(src, os.fsencode(target), None, flags, None) != 0:
                err = ctypes.get_errno()
                raise DiskLimitError(f"{what} of {source} on {target} failed: {os.strerror(err)}")
        return target

    def persistent_workspace(self, path: Path, max_bytes: int, uid: int) -> None:
        image = path / IMAGE
        wait_released(image, path, RELEASE_WAIT)
        if loops_of(image) or mounted(path):
            raise DiskLimitError(f"the workspace {path} is in use by another run (its image is attached)")
        if not image.exists():
            self._create_image(path, image, max_bytes, uid)
        size = image.stat().st_size
        if size != max_bytes:
            raise DiskLimitError(f"the workspace image {image} holds {size} bytes but the policy's max_bytes is "
                                 f"{max_bytes}: resize it offline (resize2fs) or use another workspace")
        os.chown(path, 0, 0)  # the image, not the directory, is the sandbox's: nobody else may swap it
        path.chmod(0o755)
        self._record({"target": str(path), "source": None, "image": str(image)})
        _run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev", str(image), str(path)])
        self.workspace_mount = path

    def _create_image(self, path: Path, image: Path, max_bytes: int, uid: int) -> None:
        """`mke2fs -d DIR` into `state_dir/images/<run_id>.ext4` (mke2fs must not read its own output; fifos,
        devices and symlinks are copied as such, never opened or followed), moved into DIR (a run killed
        half-way leaves DIR's content in place and no image that looks complete), then DIR's migrated entries
        are removed: from now on the content lives in the image."""
        (path / f"{IMAGE}.new").unlink(missing_ok=True)  # a partial copy of a run killed half-way
        entries = [e for e in os.listdir(path) if not e.startswith(IMAGE)]
        staging = self.state_dir / "images" / f"{self.run_id}.ext4"
        staging.parent.mkdir(mode=0o700, exist_ok=True)
        self._record({"target": None, "source": None, "image": str(staging)})
        try:
            with open(staging, "wb") as fh:
                fh.truncate(max_bytes)
            staging.chmod(0o600)
            _run(["mke2fs", "-t", "ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-N",
                  str(nr_inodes(max_bytes)), "-E", f"root_owner={uid}:{uid}", "-d", str(path), str(staging)])
            partial = path / f"{IMAGE}.new"
            try:
                staging.rename(partial)
            except OSError:  # another file system: a sparse copy
                _run(["cp", "--sparse=always", str(staging), str(partial)])
            partial.rename(image)
        except (OSError, DiskLimitError) as exc:
            raise DiskLimitError(f"cannot create the workspace image {image} ({max_bytes} bytes) from {path}: "
                                 f"{exc}") from None
        finally:
            staging.unlink(missing_ok=True)
        for entry in entries:
            target = path / entry
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()

    def full(self) -> bool:
        """The bounded workspace is at its limit: no inode left, or less free space than `full_slack`."""
        if self.workspace_mount is None:
            return False
        try:
            st = os.statvfs(self.workspace_mount)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < full_slack(st.f_blocks * st.f_frsize, st.f_frsize) or st.f_favail == 0

    def watch(self, on_full: Callable[[], None], interval: float = 0.1) -> FullWatch | None:
        if self.workspace_mount is None:
            return None
        w = FullWatch(self.full, on_full, interval)
        w.start()
        return w

    def release(self) -> None:
        """Unmount everything made (reverse order), detach the loop devices, remove the tmp directory."""
        problems = []
        for entry in reversed(self.made):
            problems += release_entry(self.run_id, self.state_dir, entry)
        self.made = []
        if problems:
            raise DiskLimitError("; ".join(problems))


class FullWatch:
    """Polls statvfs of the bounded workspace (one syscall per tick): once it is full, `on_full` runs (the
    run's kill) and `exceeded` is set. The kernel already refused the bytes; this only ends the run, as the
    policy's kill-on-exceed semantics (exit 123) ask."""

    def __init__(self, full: Callable[[], bool], on_full: Callable[[], None], interval: float) -> None:
        self.full, self.on_full, self.interval = full, on_full, interval
        self.exceeded = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="workspace-full", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.full():
                self.exceeded = True
                self.on_full()
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def release_entry(run_id: str, state_dir: Path, entry: dict) -> list[str]:
    """Remove one recorded mount of run `run_id`, after checking it is really ours: a tmpfs whose source
    names this run id, or an ext4 at DIR whose image is DIR/.egressgate-workspace.ext4. A record is data;
    nothing else is ever unmounted because one says so. Returns problems (empty when clean)."""
    image = entry.get("image")
    if entry.get("target") is None:  # an image being created in state_dir/images: only that file
        if image and Path(image) == state_dir / "images" / f"{run_id}.ext4":
            Path(image).unlink(missing_ok=True)
        return []
    target = Path(str(entry["target"]))
    if not target.is_absolute():
        return []
    problems = []
    if entry.get("bind") is not None:  # DiskLimits.bind (a named workspace) or nosuid_bind: only this run's own
        in_binds = target.parent == state_dir / "binds" / run_id
        if not in_binds and target != state_dir / "workspaces" / run_id:
            return [f"record names bind {target}: not ours, left alone"]
        while mounted(target) is not None:
            if not unmount(target):
                return [f"cannot unmount {target}"]
        with contextlib.suppress(OSError):
            if target.is_file() and not target.is_symlink():  # the empty file a file was bound on
                target.unlink()
            else:
                target.rmdir()
            if in_binds:
                target.parent.rmdir()  # once the run's last bind is gone
        return problems
    if image is None:
        expected = {f"egressgate-ws-{run_id}", f"egressgate-tmp-{run_id}"}
        while (m := mounted(target)) is not None and m[0] == "tmpfs" and m[1] in expected:
            if not unmount(target):
                problems.append(f"cannot unmount {target}")
                break
        if target == state_dir / "tmp" / run_id:
            with contextlib.suppress(OSError):
                target.rmdir()
        return problems
    img = Path(str(image))
    if img != target / IMAGE:
        return [f"record names image {img} for {target}: not ours, left alone"]
    loops = loops_of(img)
    while (m := mounted(target)) is not None and m[0] == "ext4" and m[1] in loops:
        if not unmount(target):
            problems.append(f"cannot unmount {target}")
            break
    # autoclear frees the device on unmount, asynchronously (the kernel defers it, for seconds on a loaded
    # machine): wait up to 20 s, and detach one attached but never mounted (a SIGKILL between losetup and
    # mount) explicitly
    deadline = time.monotonic() + 20
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        left = loops_of(img)
        if not left:
            break
        if attempt % 20 == 10:
            for dev in left:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    subprocess.run(["losetup", "-d", dev], capture_output=True, check=False, timeout=30)
        time.sleep(0.02)
    pending = [dev for dev in loops_of(img) if not _autoclear(dev)]
    if pending or (loops_of(img) and mounted(target) is not None):
        problems.append(f"loop device still attached to {img}")
    # an autoclear device whose file system is unmounted here but still held by another mount namespace
    # (a container's, removed asynchronously by its runtime) frees itself once that namespace goes; until
    # then the next run on this workspace is refused ("in use"), never mounted twice
    return problems


def wait_released(image: Path, path: Path, seconds: float) -> None:
    """A run that just ended can leave its image attached for a while: the device is autoclear and no longer
    mounted here, but a removed container's mount namespace (runc's, gVisor's gofer) still holds it until its
    runtime lets go, seconds later on a busy host. The next run on the workspace waits for that, up to
    `seconds`, instead of refusing it as "in use". A mount here (a live run) or a device without autoclear is
    never waited for: the caller refuses it at once."""
    deadline = time.monotonic() + seconds
    while (loops := loops_of(image)) and mounted(path) is None and all(map(_autoclear, loops)):
        if time.monotonic() >= deadline:
            return
        time.sleep(0.1)


def _autoclear(dev: str) -> bool:
    try:
        return Path(f"/sys/block/{Path(dev).name}/loop/autoclear").read_text().strip() == "1"
    except OSError:
        return False


def orphans(state_dir: Path, live: set[str]) -> list[str]:
    """Bounded tmpfs mounts (`egressgate-ws|tmp-<id>`) under THIS state dir (`workspaces/<id>`, `tmp/<id>`:
    their runs' records live here, written before the mount), and nosuid binds at `binds/<id>/<n>`, whose
    run no live record holds: unmounted by gc's second pass. Mounts of another state dir's runs are never
    touched."""
    removed = []
    binds = state_dir / "binds"
    for point in dict.fromkeys(p for p, _fstype, _source in reversed(mounts())):  # nosuid_bind's
        run_dir = Path(point).parent
        if (run_dir.parent == binds and RUN_ID_RE.match(run_dir.name) and run_dir.name not in live
                and not release_entry(run_dir.name, state_dir, {"target": point, "bind": "?"})):
            removed.append(f"orphan bind {point}")
    for point, fstype, source in mounts():
        m = SOURCE_RE.match(source)
        if not (fstype == "tmpfs" and m and m[2] not in live):
            continue
        if Path(point) in (state_dir / "workspaces" / m[2], state_dir / "tmp" / m[2]) and unmount(Path(point)):
            removed.append(f"orphan mount {point}")
    return removed
