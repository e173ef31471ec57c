"""Let pytest rewrite the test modules once, before `make test`'s xdist workers start.

Why: pytest rewrites every test module's asserts at import and caches the result in __pycache__. On a fresh
clone nothing is cached, so each of the 4 workers rewrote all ~450 modules itself at collection: ~21 CPU-s
per worker instead of ~8 with the cache, ~50 CPU-s of a CPU-bound run. Here the modules are collected once,
split over one process per core; the workers then load the cached rewrites. Only a warm-up: a collection
error is left for the real run to report, so the exit code is always 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def parts() -> list[Path]:
    """The suite's top-level folders and modules (support code is imported by the tests that use it)."""
    folders = [p for p in TESTS.iterdir() if p.is_dir() and p.name not in ("__pycache__", "support")]
    return sorted([*folders, *TESTS.glob("test_*.py")])


def main() -> int:
    n = max(1, min(os.cpu_count() or 1, 4))
    shares = [parts()[i::n] for i in range(n)]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    procs = [
        subprocess.Popen([*cmd, *map(str, share)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        for share in shares
        if share
    ]
    for proc in procs:
        proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
