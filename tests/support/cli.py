"""Running the real console entry point as an operator does, and the tools that check what it writes
(the deployment-file renderers' tests, and any test that needs the repository's own policies)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "policies"


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """The real console entry point (`python -m egressgate`), as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "egressgate", *args], capture_output=True, text=True, cwd=cwd,
                          check=False, timeout=120)


def kubernetes_validate() -> str:
    """The kubernetes-validate script of this interpreter's environment (dev extra); never skipped."""
    found = Path(sys.executable).with_name("kubernetes-validate")
    if found.exists():
        return str(found)
    other = shutil.which("kubernetes-validate")
    if other is None:
        pytest.fail("kubernetes-validate is missing: pip install -e '.[dev]'")
    return other
