"""`--workspace` paths a sandbox could have redirected. A workspace survives its run, so what an earlier
sandbox left in it (a symlink to a root-owned directory) must never make the next `sandbox run` chown
that directory to the sandbox uid and bind it read-write. Real files, real chown (tests run as root)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes.base import SANDBOX_UID
from egressgate.runtimes.workload import SetupFailed, prepare_workspace


@pytest.fixture
def tree() -> Iterator[tuple[Path, Path, Path]]:
    """An earlier workspace (owned by the sandbox uid) and a root-only directory next to it (in a temp
    dir the sandbox uid can traverse: pytest's tmp_path is under a 0700 directory)."""
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    tmp_path = Path(tempfile.mkdtemp(prefix="egV-"))
    tmp_path.chmod(0o711)
    earlier = tmp_path / "earlier-ws"
    earlier.mkdir()
    os.chown(earlier, SANDBOX_UID, SANDBOX_UID)
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    yield tmp_path, earlier, secret
    shutil.rmtree(tmp_path)


def plant(link: Path, target: Path) -> None:
    """What the earlier sandbox did from inside: a symlink it owns."""
    link.symlink_to(target)
    os.lchown(link, SANDBOX_UID, SANDBOX_UID)


def test_a_symlink_planted_in_an_earlier_workspace_is_refused(tree: tuple[Path, Path, Path]) -> None:
    _base, earlier, secret = tree
    plant(earlier / "project", secret)
    with pytest.raises(SetupFailed, match="controls"):
        prepare_workspace(earlier / "project")
    assert secret.stat().st_uid == 0  # nothing was chowned


def test_a_symlink_to_a_planted_symlink_is_refused(tree: tuple[Path, Path, Path]) -> None:
    base, earlier, secret = tree
    plant(earlier / "project", secret)
    (base / "alias").symlink_to(earlier / "project")  # root's own link, leading through the planted one
    with pytest.raises(SetupFailed, match="controls"):
        prepare_workspace(base / "alias")
    assert secret.stat().st_uid == 0


def test_a_directory_inside_an_earlier_workspace_is_refused(tree: tuple[Path, Path, Path]) -> None:
    """A concurrent run could swap it for a symlink between the check and the mount."""
    _base, earlier, _secret = tree
    (earlier / "sub").mkdir()
    with pytest.raises(SetupFailed, match="controls"):
        prepare_workspace(earlier / "sub")


def test_positive_controls(tree: tuple[Path, Path, Path]) -> None:
    """An earlier workspace itself is reused (that is what --workspace is for); a fresh directory and a
    symlink root made to it are given to the sandbox uid and resolved."""
    base, earlier, _secret = tree
    assert prepare_workspace(earlier) == earlier.resolve()
    fresh = base / "fresh"
    (base / "link").symlink_to(fresh)
    fresh.mkdir()
    assert prepare_workspace(base / "link") == fresh.resolve()
    assert fresh.stat().st_uid == SANDBOX_UID
