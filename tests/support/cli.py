"""Running the real console entry point as an operator does, and the tools that check what it writes
(the deployment-file renderers' tests, and any test that needs the repository's own policies)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support import zygote

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "policies"


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """The real console entry point (`python -m egressgate`), as an operator runs it: forked from the test
    fork server (tests/support/zygote.py: the same process, without re-importing what `egressgate run`
    imports; EGRESSGATE_TEST_ZYGOTE=0 execs it)."""
    return run([sys.executable, "-m", "egressgate", *args], cwd=cwd)


def run(
    argv: list[str],
    *,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    netns: str | None = None,
    stdin: int | None = None,
    timeout: float = 120,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, capture_output=True, text=True, ...)` for an `egressgate` command (the console
    script or `python -m egressgate`; `netns`: as `ip netns exec NETNS ARGV`), started through
    `zygote.popen` (forked when that is indistinguishable to the command, exec'd otherwise). Like
    subprocess.run it kills the command and raises TimeoutExpired after `timeout`, and raises
    CalledProcessError on a non-zero exit with `check`. Output goes to files, never a pipe to drain."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = zygote.popen(argv, cwd=cwd, env=env, netns=netns, stdin=stdin, stdout=out, stderr=err, text=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        res = subprocess.CompletedProcess(argv, code, out.read(), err.read())
    if check:
        res.check_returncode()
    return res


def kubernetes_validate() -> str:
    """The kubernetes-validate script of this interpreter's environment (dev extra); never skipped."""
    found = Path(sys.executable).with_name("kubernetes-validate")
    if found.exists():
        return str(found)
    other = shutil.which("kubernetes-validate")
    if other is None:
        pytest.fail("kubernetes-validate is missing: pip install -e '.[dev]'")
    return other
