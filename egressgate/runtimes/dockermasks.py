"""`filesystem.deny` for containers: cover each denied path with an empty, read-only, root-owned file or
directory, whichever the path is in the image.

Why a probe: a bind mount must match the kind of what it covers (a directory over a file fails the
container start), and the kind depends on the image (and, for /proc and /sys, on the runtime: gVisor's
are synthetic). HostConfig.MaskedPaths would replace the daemon's default masked /proc paths rather than
add to them, so the image is asked once instead: a throwaway container (no network, no capability,
read-only, our static busybox as the only program run) stats the paths. The answer is cached by image
ID + runtime + paths under the state dir, so only the first run of an image pays for it (~0.3 s); later
runs pay one image lookup over the socket (~1 ms). A path the image does not have needs no mask on a
read-only root (the workload cannot create it); paths inside the workspace or a `filesystem.allow` bind
are judged on the host, where they live.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from egressgate.runtimes import seccompjson
from egressgate.runtimes.dockerapi import DockerError, bind

if TYPE_CHECKING:
    from egressgate.runtimes.dockerapi import DockerAPI

PROBE = 'for p; do t=$(/.egressgate/busybox stat -L -c %F "$p" 2>/dev/null) || t=absent; echo "$t"; done'


def _under(path: str, root: str | None) -> bool:
    return bool(root) and (path == root or path.startswith(root.rstrip("/") + "/"))


def kinds(api: DockerAPI, image: str, paths: list[str], oci_runtime: str | None, state_dir: Path,
          host_trees: list[tuple[Path, str]] | None = None) -> dict[str, str]:
    """path → "dir" | "file" | "absent" for every path (see the module docstring). `host_trees`: (host
    path, container path) of every host bind (the workspace, `filesystem.allow` paths): a denied path
    inside one is judged on the host (the innermost tree wins)."""
    from egressgate.runtimes.docker import BUSYBOX

    out: dict[str, str] = {}
    probe: list[str] = []
    for path in paths:
        if not PurePosixPath(path).is_absolute():
            raise DockerError(f"filesystem.deny path {path!r} is not absolute")
        tree = max((t for t in host_trees or [] if _under(path, t[1])), key=lambda t: len(t[1]), default=None)
        if tree is not None:
            host_path = tree[0] / os.path.relpath(path, tree[1])
            out[path] = "dir" if host_path.is_dir() else "file" if host_path.exists() else "absent"
        else:
            probe.append(path)
    if not probe:
        return out
    image_id = api.image_id(image)
    key = hashlib.sha256(json.dumps([api.host, image_id, oci_runtime, probe]).encode()).hexdigest()[:24]
    cache = state_dir / "docker" / "probes" / f"{key}.json"
    try:
        out.update(json.loads(cache.read_text()))
        return out
    except (OSError, ValueError):
        pass
    # the same seccomp profile as the workload's: every container egressgate starts gets it
    host: dict = {"NetworkMode": "none", "CapDrop": ["ALL"],
                  "SecurityOpt": ["no-new-privileges", seccompjson.security_opt(runtime=oci_runtime)],
                  "ReadonlyRootfs": True, "Mounts": [bind(BUSYBOX, "/.egressgate/busybox")]}
    if oci_runtime:
        host["Runtime"] = oci_runtime
    name = f"egressgate-probe-{os.getpid()}-{os.urandom(3).hex()}"
    config = {"Image": image_id, "User": "0:0", "Labels": {"egressgate.probe": "1"},
              "Entrypoint": ["/.egressgate/busybox"], "Cmd": ["sh", "-c", PROBE, "probe", *probe],
              "Tty": False, "HostConfig": host}
    try:
        api.create(name, config)
        api.start(name)
        api.wait(name, 120.0)
        lines = b"".join(data for stream, data in api.logs(name, follow=False, timeout=30.0)
                         if stream == 1).decode(errors="replace").splitlines()
    except TimeoutError:
        raise DockerError(f"probing filesystem.deny paths in {image} timed out") from None
    finally:
        with contextlib.suppress(DockerError):
            api.remove(name)
    if len(lines) != len(probe):
        raise DockerError(f"probing filesystem.deny paths in {image} gave {lines!r}")
    found = {p: ("dir" if t == "directory" else "absent" if t == "absent" else "file")
             for p, t in zip(probe, lines, strict=True)}
    cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = cache.with_suffix(f".{os.getpid()}")
    tmp.write_text(json.dumps(found))
    tmp.replace(cache)
    out.update(found)
    return out


def mounts(kinds_by_path: dict[str, str], run_dir: Path) -> list[dict[str, object]]:
    """HostConfig.Mounts entries covering every present path with an empty read-only file or directory."""

    empty_file, empty_dir = run_dir / "mask-file", run_dir / "mask-dir"
    out: list[dict[str, object]] = []
    for path, kind in kinds_by_path.items():
        if kind == "absent":
            continue
        if kind == "dir":
            empty_dir.mkdir(exist_ok=True)
            empty_dir.chmod(0o555)
            src = empty_dir
        else:
            empty_file.touch(exist_ok=True)
            empty_file.chmod(0o000)
            src = empty_file
        out.append(bind(src, path))
    return out
