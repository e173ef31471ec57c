"""The guest's root file system: an ext4 image the guest mounts read-only (virtio-blk, QEMU opens it
read-only and shares it between concurrent runs).

`egressgate runtime image build` makes the default one with mmdebstrap (Debian `essential` plus the
requested packages, python3 by default; docs, man pages, locales and apt lists dropped) and `mkfs.ext4 -d`,
cached under the artifact dir by the hash of the recipe (suite, mirror, packages), so rebuilding an
unchanged recipe is free and a changed one never reuses a stale image. An operator may instead give
`--image` an ext4 image file or a directory (packed into a cached image keyed by the tree's names, sizes
and mtimes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from egressgate.runtimes.microvm.artifacts import ArtifactError, cache_dir

DEFAULT_SUITE = "bookworm"
DEFAULT_PACKAGES = ("python3",)
DROP = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/log",
)
RECIPE_VERSION = 1
HEADROOM = 64 * 1024 * 1024  # free space in the image (the guest mounts it read-only; ext4 metadata)


def default_mirror() -> str:
    """The first Debian archive of the machine's apt sources (what scripts/build-images.sh uses)."""
    found: list[str] = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = path.read_text()
        except OSError:
            continue
        found += re.findall(r"^(?:URIs:|deb)\s+(https?://\S+)", text, re.MULTILINE)
    debian = [u for u in found if re.search(r"/debian/?$", u)]
    return debian[0] if debian else "http://deb.debian.org/debian"


def recipe_key(suite: str, mirror: str, packages: tuple[str, ...]) -> str:
    recipe = {"v": RECIPE_VERSION, "suite": suite, "mirror": mirror, "packages": sorted(packages)}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def default_image(base: Path | None = None) -> Path | None:
    """The image `runtime image build` made last (its path is in `root.json`), or None."""
    base = base or cache_dir()
    try:
        path = Path(json.loads((base / "root.json").read_text())["image"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if path.is_file() else None


def build(
    suite: str = DEFAULT_SUITE,
    packages: tuple[str, ...] = DEFAULT_PACKAGES,
    mirror: str | None = None,
    base: Path | None = None,
) -> Path:
    """mmdebstrap → directory → ext4 image, cached by recipe; records it as the default image."""
    base = base or cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    mirror = mirror or default_mirror()
    out = base / f"root-{recipe_key(suite, mirror, packages)}.ext4"
    if not out.is_file():
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            tree = Path(tmp) / "tree"
            argv = ["mmdebstrap", "--quiet", "--variant=essential", "--format=directory"]
            if packages:
                argv.append("--include=" + ",".join(packages))
            res = subprocess.run(
                [*argv, suite, str(tree), mirror], capture_output=True, text=True, check=False, timeout=1800
            )
            if res.returncode != 0:
                raise ArtifactError(f"mmdebstrap failed ({res.returncode}): {res.stderr.strip()[-600:]}")
            for sub in DROP:
                shutil.rmtree(tree / sub, ignore_errors=True)
            pack(tree, out)
    (base / "root.json.tmp").write_text(json.dumps({"image": str(out), "suite": suite, "packages": list(packages)}))
    (base / "root.json.tmp").replace(base / "root.json")
    return out


def _tree_size(tree: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in filenames + dirnames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512 + 4096
    return total


def mkfs_ext4(image: Path, tree: Path, size: str, *options: str, timeout: float) -> subprocess.CompletedProcess:
    """`mkfs.ext4 -d TREE` into `image` (created or overwritten) of `size` (mkfs's units: 512M, 4096k):
    no journal (every image here is either read-only or lives for one run), no reserved blocks."""
    return subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", *options, "-d", str(tree), str(image), size],
        capture_output=True, text=True, check=False, timeout=timeout)


def pack(tree: Path, out: Path) -> None:
    """`mkfs.ext4 -d`: an image of exactly the tree (no journal: it is only ever mounted read-only)."""
    size = (_tree_size(tree) * 5 // 4 + HEADROOM + (1 << 20) - 1) // (1 << 20)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    res = mkfs_ext4(tmp, tree, f"{size}M", "-L", "egressgate-root", timeout=1800)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ArtifactError(f"mkfs.ext4 -d {tree} failed: {res.stderr.strip()[-400:]}")
    os.chmod(tmp, 0o644)
    tmp.replace(out)


def tree_key(tree: Path) -> str:
    """A cheap identity of a directory tree: every path, mode, size and mtime."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            digest.update(f"{full}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def resolve(image: str | None, base: Path | None = None) -> Path:
    """The root image of a run: `--image` (an ext4 file, or a directory packed into a cached image) or the
    default one. ArtifactError names the command that makes it."""
    base = base or cache_dir()
    if image is None:
        found = default_image(base)
        if found is None:
            raise ArtifactError(
                "no microvm root image: run `egressgate runtime image build` (or pass --image "
                "an ext4 image or a directory)"
            )
        return found
    path = Path(image)
    if path.is_file():
        with path.open("rb") as fh:
            fh.seek(1024 + 56)
            if fh.read(2) != b"\x53\xef":
                raise ArtifactError(f"--image {image}: not an ext4 image (and not a directory)")
        return path.absolute()
    if path.is_dir():
        out = base / f"dir-{tree_key(path.absolute())}.ext4"
        if not out.is_file():
            base.mkdir(parents=True, exist_ok=True)
            pack(path, out)
        return out
    raise ArtifactError(f"--image {image}: no such file or directory")
