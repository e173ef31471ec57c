"""The guest's kernel and initramfs: Debian's cloud kernel, extracted (never installed on the host), and a
small initramfs of the static busybox, the ~10 virtio modules that kernel builds as modules, and init.sh.

Why these choices (measured, issue 24): the uncompressed `vmlinux` boots through its PVH entry, which saves
the decompression (slow under TCG); the cloud kernel has no 9p and builds virtio as modules, so the
initramfs carries exactly the drivers the microvm machine needs (virtio-mmio, blk, net, console, rng) plus
overlay for the read-only root. Everything is cached under the artifact dir, keyed by content: a changed
init.sh or busybox gives a new initramfs file, so a stale cache is never used.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

KERNEL_PACKAGE = "linux-image-cloud-amd64"  # Debian's meta-package: depends on the current cloud kernel
BUSYBOX = Path("/bin/busybox")
MODULES = ("virtio_mmio", "virtio_blk", "virtio_net", "virtio_console", "virtio_rng", "overlay")
INIT = Path(__file__).with_name("init.sh")
# compressed payloads a bzImage may carry: (magic, decompressor argv reading stdin)
PAYLOADS = (
    (b"\x02\x21\x4c\x18", ["lz4", "-dc"]),
    (b"\xfd7zXZ\x00", ["xz", "-dc"]),
    (b"\x28\xb5\x2f\xfd", ["zstd", "-dc"]),
    (b"\x1f\x8b\x08\x00", ["gzip", "-dc"]),
)


class ArtifactError(RuntimeError):
    """An artifact is missing or cannot be built; the message says what to run."""


def cache_dir() -> Path:
    """`EGRESSGATE_MICROVM_DIR`, else ~/.cache/egressgate/microvm (like scripts/build-images.sh's cache)."""
    value = os.environ.get("EGRESSGATE_MICROVM_DIR")
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "egressgate" / "microvm"


def _run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[bytes]:
    res = subprocess.run(argv, capture_output=True, check=False, timeout=600, **kw)  # type: ignore[call-overload]
    if res.returncode != 0:
        detail = res.stderr.decode(errors="replace").strip()[-400:]
        raise ArtifactError(f"{' '.join(argv[:3])} failed ({res.returncode}): {detail}")
    return res


def kernel_dir(base: Path | None = None) -> Path | None:
    """The newest extracted kernel (`kernel-<release>/` holding vmlinux and modules/), or None."""
    base = base or cache_dir()
    found = sorted(base.glob("kernel-*/vmlinux"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def fetch_kernel(base: Path | None = None) -> Path:
    """apt-get download the cloud kernel package, extract it (dpkg-deb -x), keep vmlinux and the modules
    of MODULES (with their dependencies). Idempotent per kernel release."""
    base = base or cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    deps = _run(["apt-cache", "depends", KERNEL_PACKAGE]).stdout.decode()
    match = re.search(r"Depends: (linux-image-[0-9][^\s]*)", deps)
    if match is None and os.geteuid() == 0:  # a fresh machine's empty package lists: fetch them once
        _run(["apt-get", "update", "-qq"])
        deps = _run(["apt-cache", "depends", KERNEL_PACKAGE]).stdout.decode()
        match = re.search(r"Depends: (linux-image-[0-9][^\s]*)", deps)
    if match is None:
        raise ArtifactError(f"apt-cache knows no kernel for {KERNEL_PACKAGE} (run apt-get update)")
    package = match.group(1)
    release = package.removeprefix("linux-image-")
    target = base / f"kernel-{release}"
    if (target / "vmlinux").is_file():
        return target
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)  # noqa: S103 - apt's _apt user downloads into it
        _run(["apt-get", "download", "-q", package], cwd=work)
        deb = next(work.glob("*.deb"))
        _run(["dpkg-deb", "-x", str(deb), str(work / "x")])
        vmlinuz = next((work / "x" / "boot").glob("vmlinuz-*"))
        stage = work / "out"
        (stage / "modules").mkdir(parents=True)
        extract_vmlinux(vmlinuz, stage / "vmlinux")
        tree = next((work / "x").glob("lib/modules/*/kernel"))
        for name in module_order(tree, MODULES):
            shutil.copy2(_index(tree)[name], stage / "modules" / f"{name}.ko")
        (stage / "modules" / "order").write_text("\n".join(module_order(tree, MODULES)) + "\n")
        (stage / "release").write_text(release + "\n")
        for path in [stage, *stage.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)  # QEMU (the run's uid) reads them
        if target.exists():
            shutil.rmtree(target)
        stage.rename(target)
    return target


def extract_vmlinux(vmlinuz: Path, out: Path) -> None:
    """The ELF inside a bzImage: the first compressed payload that decompresses to an ELF."""
    data = vmlinuz.read_bytes()
    for magic, argv in PAYLOADS:
        start = data.find(magic)
        while start != -1:
            if shutil.which(argv[0]) is None:
                raise ArtifactError(f"the kernel is compressed with {argv[0]}, which is not installed")
            # decompressors exit non-zero on the trailing bytes after the payload: the output is judged
            res = subprocess.run(argv, input=data[start:], capture_output=True, check=False, timeout=300)
            if res.stdout[:4] == b"\x7fELF":
                out.write_bytes(res.stdout)
                return
            start = data.find(magic, start + 1)
    raise ArtifactError(f"no known compressed kernel inside {vmlinuz}")


def _index(tree: Path) -> dict[str, Path]:
    return {p.name[:-3].replace("-", "_"): p for p in tree.rglob("*.ko")}


def module_order(tree: Path, wanted: tuple[str, ...]) -> list[str]:
    """`wanted` and their dependencies (the `depends=` of each module's .modinfo), dependencies first."""
    index = _index(tree)
    order: list[str] = []

    def add(name: str) -> None:
        if name in order:
            return
        if name not in index:
            raise ArtifactError(f"the kernel has no module {name}")
        found = re.search(rb"depends=([^\0]*)\0", index[name].read_bytes())
        for dep in found.group(1).decode().split(",") if found else []:
            if dep:
                add(dep.replace("-", "_"))
        order.append(name)

    for name in wanted:
        add(name)
    return order


# ------------------------------------------------------------------------------------------- initramfs
def _cpio_entry(name: str, mode: int, data: bytes = b"", ino: int = 0) -> bytes:
    """One `newc` cpio record (what the kernel's initramfs unpacker reads)."""
    encoded = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
    head = b"070701" + b"".join(f"{v:08x}".encode() for v in fields) + encoded
    head += b"\0" * (-len(head) % 4)
    return head + data + b"\0" * (-len(data) % 4)


def build_initramfs(kernel: Path, out: Path) -> None:
    """busybox (with a symlink per applet init.sh uses), the modules, /etc/modules (load order), /init."""
    busybox = BUSYBOX.read_bytes()
    entries = [
        ("dev", 0o40755, b""),
        ("proc", 0o40755, b""),
        ("sys", 0o40755, b""),
        ("run", 0o40755, b""),
        ("mnt", 0o40755, b""),
        ("etc", 0o40755, b""),
        ("bin", 0o40755, b""),
        ("lib", 0o40755, b""),
        ("lib/modules", 0o40755, b""),
        ("bin/busybox", 0o100755, busybox),
        ("init", 0o100755, INIT.read_bytes()),
    ]
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    entries += [(f"bin/{a}", 0o120777, b"busybox") for a in applets if a != "busybox"]
    order = (kernel / "modules" / "order").read_text().split()
    entries.append(("etc/modules", 0o100644, ("\n".join(order) + "\n").encode()))
    entries += [(f"lib/modules/{m}.ko", 0o100644, (kernel / "modules" / f"{m}.ko").read_bytes()) for m in order]
    body = b"".join(_cpio_entry(name, mode, data, i + 1) for i, (name, mode, data) in enumerate(entries))
    body += _cpio_entry("TRAILER!!!", 0)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(body)
    os.chmod(tmp, 0o644)
    tmp.replace(out)


def initramfs(kernel: Path) -> Path:
    """The initramfs for `kernel`, built when missing; its name is the hash of its inputs."""
    st = BUSYBOX.stat()
    key = hashlib.sha256(INIT.read_bytes() + f"{st.st_size}:{st.st_mtime_ns}:{kernel.name}".encode()).hexdigest()
    out = kernel / f"initramfs-{key[:16]}.cpio"
    if not out.is_file():
        for old in kernel.glob("initramfs-*.cpio"):  # older inits (a VM that opened one keeps its fd)
            if old != out:
                old.unlink(missing_ok=True)
        build_initramfs(kernel, out)
    return out
