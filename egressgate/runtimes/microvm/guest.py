"""What travels between `sandbox run` and the guest's init (init.sh): the run payload sent over `eg.in`, the
status line read from `eg.status`, and the sizes a policy's resources give the VM. Pure apart from reading
the CA bundle and running mkfs.ext4 for the workspace image."""

from __future__ import annotations

import io
import math
import os
import re
import shlex
import tarfile
from pathlib import Path

from egressgate.runtimes import sandbox_fs
from egressgate.runtimes.base import ExitInfo, Limit, RunSpec
from egressgate.runtimes.diskfs import DEFAULT_TMP_MAX_BYTES

GUEST_OVERHEAD_MB = 96  # guest RAM above the workload's memory.max: kernel, init, page cache
QEMU_OVERHEAD_MB = 256  # QEMU's host cgroup above guest RAM: translation cache, device state, QEMU itself
DEFAULT_GUEST_MB = 512
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class GuestFailed(RuntimeError):
    """The guest could not start the workload (its init said why, or QEMU ended without a word)."""


def sizes(resources: dict) -> tuple[int, int | None, int]:
    """(guest RAM MiB, the workload's memory.max in MiB or None, vCPUs) for `sandbox.resources`."""
    memory = resources.get("memory_mb")
    guest = memory + GUEST_OVERHEAD_MB if memory else DEFAULT_GUEST_MB
    cpu = resources.get("cpu_millis")
    vcpus = max(1, min(math.ceil(cpu / 1000), os.cpu_count() or 1)) if cpu else 1
    return guest, memory, vcpus


def host_limits(resources: dict) -> dict[str, int]:
    """QEMU's own cgroup (run.py `_limits`): always a memory ceiling (guest RAM + QEMU's overhead), the
    policy's CPU quota. pids_max is enforced inside the guest (QEMU's threads are not the workload)."""
    guest, _, _ = sizes(resources)
    out = {"memory_mb": guest + QEMU_OVERHEAD_MB}
    if resources.get("cpu_millis"):
        out["cpu_millis"] = resources["cpu_millis"]
    return out


def _q(value: object) -> str:
    return shlex.quote(str(value))


def run_payload(spec: RunSpec, ws_path: str | None, export: bool = False) -> bytes:
    """The tar init.sh reads from eg.in (see its header)."""
    sandbox = spec.policy.get("sandbox") or {}
    resources = sandbox.get("resources") or {}
    _, memory, _ = sizes(resources)
    for key, value in spec.env.items():
        if not ENV_NAME.match(key) or "\0" in value:
            raise ValueError(f"environment variable {key!r} cannot be passed to the guest (not a shell name, or NUL)")
    for word in spec.command:
        if "\0" in word:
            raise ValueError("a command word contains NUL")
    hostname = str(sandbox.get("name") or "sandbox")[:63]
    config = {
        "EG_IP": spec.address.sandbox_ip,
        "EG_GW": spec.address.host_ip,
        "EG_PREFIX": spec.address.prefix_len,
        "EG_HOSTNAME": re.sub(r"[^A-Za-z0-9.-]", "-", hostname) or "sandbox",
        "EG_UID": spec.uid,
        "EG_GID": spec.gid,
        "EG_WS": ws_path or "",
        "EG_CWD": ws_path or "/tmp",  # noqa: S108
        "EG_TMP_BYTES": int((sandbox.get("tmp") or {}).get("max_bytes") or DEFAULT_TMP_MAX_BYTES),
        "EG_MEM_BYTES": memory * 1024 * 1024 if memory else "",
        "EG_PIDS_MAX": resources.get("pids_max") or "",
        "EG_ROOT_RW": "1" if sandbox.get("root_fs") == "read_write" else "",
        "EG_WS_EXPORT": "1" if export and ws_path else "",
    }
    users, groups = sandbox_fs.passwd(spec.uid, spec.gid)
    deny = [os.path.normpath(p) for p in (spec.policy.get("filesystem") or {}).get("deny") or []]
    files = {
        "config": "".join(f"{k}={_q(v)}\n" for k, v in config.items()).encode(),
        "env": "".join(f"export {k}={_q(v)}\n" for k, v in spec.env.items()).encode(),
        "argv": ("set -- " + " ".join(_q(w) for w in spec.command) + "\n").encode(),
        "deny": "".join(f"{p}\n" for p in deny if p.startswith("/") and "\n" not in p).encode(),
        "ca.pem": spec.ca_bundle.read_bytes(),
        "resolv.conf": f"nameserver {spec.address.host_ip}\noptions edns0\n".encode(),
        "hosts": f"127.0.0.1\tlocalhost\n{spec.address.sandbox_ip}\t{config['EG_HOSTNAME']}\n".encode(),
        "passwd": users,
        "group": groups,
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o600
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def parse_status(line: str) -> ExitInfo:
    """init.sh's `exit RC oom N pids N full N` → ExitInfo; `setup-failed ...` → GuestFailed."""
    words = line.split()
    if words[:1] == ["setup-failed"]:
        raise GuestFailed("the guest could not start the workload: " + " ".join(words[1:]))
    if len(words) != 8 or words[0::2] != ["exit", "oom", "pids", "full"] or not all(w.isdigit() for w in words[1::2]):
        raise GuestFailed(f"the guest reported an unreadable status: {line[:200]!r}")
    rc, oom, pids, full = (int(w) for w in words[1::2])
    limit = Limit.MEMORY if oom else Limit.PIDS if pids else Limit.WORKSPACE_BYTES if full else None
    if rc > 128 and rc - 128 < 65:  # the shell's 128+N: killed by signal N
        return ExitInfo(status=None, signal=rc - 128, limit=limit)
    return ExitInfo(status=rc, limit=limit)


def make_workspace_image(path: Path, content: Path, size: int, uid: int, gid: int) -> None:
    """A sparse ext4 image of `size` bytes holding `content`, its root owned by the run's uid (no journal:
    it lives for one run; mounted nosuid,nodev in the guest)."""
    from egressgate.runtimes.microvm.image import mkfs_ext4

    res = mkfs_ext4(path, content, f"{max(size // 1024, 1024)}k", "-E", f"root_owner={uid}:{gid},nodiscard",
                    timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"mkfs.ext4 for the workspace image failed: {res.stderr.strip()[-300:]}")
