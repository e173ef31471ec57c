"""Container images built offline for the test dockerd (there is no image registry here).

- busybox: the host's static /bin/busybox, its applet links, /etc/passwd and /etc/group (root and
  nobody), a root-only /etc/shadow (so "unreadable by the workload" is a real check), /tmp and a
  world-writable /scratch (so "read-only root" is checked by a write the permissions would allow): ~0.1 s.
- python: Debian's python3 + ca-certificates, made by mmdebstrap from the machine's own apt mirror (a
  package install, not test traffic). ~20 s, so the root filesystem tarball is cached on disk, keyed by
  everything that determines it (suite, packages, mirror); `docker import` of the cached tar is ~3 s.
- threaded: the same with python3-grpcio and nodejs (programs that start threads of their own), built
  the same way, on first use only.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support.dockerd import Dockerd

BUSYBOX = "/usr/bin/busybox"  # Debian busybox-static (statically linked: runs in any image)
PYTHON_PACKAGES = ("python3", "ca-certificates")
THREADED_PACKAGES = ("python3", "python3-grpcio", "nodejs", "ca-certificates")
CACHE = Path(os.environ.get("EGRESSGATE_IMAGE_CACHE", "/var/cache/egressgate-tests"))
PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    import io

    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def busybox(d: Dockerd) -> str:
    """Import the busybox image into `d`; returns its tag."""
    tag = "egd-busybox:1"
    root = d.state / "img-busybox.tar"
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    with tarfile.open(root, "w") as tar:
        for directory, mode in (("bin", 0o755), ("etc", 0o755), ("tmp", 0o1777), ("root", 0o700),
                                ("scratch", 0o1777)):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        tar.add(BUSYBOX, "bin/busybox")
        for applet in applets:
            if applet != "busybox":
                info = tarfile.TarInfo(f"bin/{applet}")
                info.type, info.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(info)
        _add(tar, "etc/passwd", PASSWD.encode())
        _add(tar, "etc/group", GROUP.encode())
        _add(tar, "etc/shadow", b"root:$6$canary$notarealhash:19000:0:99999:7:::\n", 0o600)
    d.docker("import", "-c", "ENV PATH=/bin", str(root), tag, timeout=120)
    root.unlink()
    return tag


def _mirror() -> tuple[str, str]:
    """(suite, mirror URI) of this machine's Debian apt sources (deb822 or one-line format)."""
    suite = "bookworm"
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            suite = line.split("=", 1)[1].strip('"') or suite
    sources = [*sorted(Path("/etc/apt/sources.list.d").glob("*.sources")), Path("/etc/apt/sources.list")]
    for path in sources:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] == ["URIs:"] and "security" not in line:
                return suite, words[1]
            if words[:1] == ["deb"] and "security" not in line:
                return suite, next(w for w in words[1:] if not w.startswith("["))
    return suite, "http://deb.debian.org/debian"


def python(d: Dockerd) -> str:
    """Import the python image into `d` (building the cached rootfs tarball when missing)."""
    return debian(d, "python", PYTHON_PACKAGES)


def threaded(d: Dockerd) -> str:
    """Debian's python3 + grpcio and node: runtimes that start threads of their own (libuv's pool, V8's
    platform threads, gRPC's pollers) for the thread tests under gVisor."""
    return debian(d, "threaded", THREADED_PACKAGES)


def debian(d: Dockerd, name: str, packages: tuple[str, ...]) -> str:
    """Import a Debian image of `packages` into `d` as egd-NAME (the rootfs tarball cached on disk)."""
    suite, mirror = _mirror()
    key = hashlib.sha256(f"{suite}|{mirror}|{','.join(packages)}".encode()).hexdigest()[:16]
    cached = CACHE / f"{name}-{key}.tar"
    if not cached.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.partial")
        res = subprocess.run(
            ["mmdebstrap", "--quiet", "--format=tar", "--variant=essential", f"--include={','.join(packages)}",
             suite, str(partial), mirror], capture_output=True, text=True, timeout=600, check=False)
        if res.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"mmdebstrap failed ({res.returncode}): {res.stderr[-3000:]}")
        partial.replace(cached)
    tag = f"egd-{name}:{key}"
    d.docker("import", "-c", "ENV PATH=/usr/local/bin:/usr/bin:/bin", str(cached), tag, timeout=300)
    return tag
