"""Python client libraries for programs that run INSIDE a sandbox (tests/runtimes/test_client_matrix.py).

A sandbox runs Debian's /usr/bin/python3 (the test venv's interpreter lives under /root, which the sandbox
uid cannot reach), so the clients an agent would use (requests, httpx, aiohttp, the OpenAI SDK, websockets,
grpcio) are installed from PyPI for that interpreter with `pip install --target` into a world-readable
cache directory, keyed by the requirement list (a package install, not test traffic; like images.python,
built once and reused). The sandbox gets the directory through a read-only `filesystem.allow` entry and the
program puts it on sys.path itself. Prefetched by scripts/install-test-deps.sh (`python -m` this module).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.images import CACHE

SANDBOX_PYTHON = "/usr/bin/python3"
REQUIREMENTS = ("requests>=2.32", "httpx>=0.27", "aiohttp>=3.10", "openai>=1.50", "websockets>=14", "grpcio>=1.60")


def ensure(requirements: tuple[str, ...] = REQUIREMENTS) -> Path:
    """The target directory holding `requirements` for SANDBOX_PYTHON (installed when missing)."""
    version = subprocess.run([SANDBOX_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    key = hashlib.sha256(f"{version}|{'|'.join(requirements)}".encode()).hexdigest()[:16]
    target = CACHE / f"sandbox-py-{key}"
    if target.is_dir():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    CACHE.chmod(0o755)
    partial = CACHE / f".sandbox-py-{key}.{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    res = subprocess.run([SANDBOX_PYTHON, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                          "--no-warn-script-location", "--break-system-packages", "--only-binary=:all:",
                          "--target", str(partial), *requirements],
                         capture_output=True, text=True, timeout=900, check=False)
    if res.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"pip install --target for the sandbox's python failed: {res.stderr[-3000:]}")
    for root, dirs, files in os.walk(partial):  # readable by every sandbox uid
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)  # noqa: S103 - library code, read by the sandbox uid
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644 | (os.stat(path).st_mode & 0o111))
    partial.chmod(0o755)
    try:
        partial.rename(target)
    except OSError:  # another worker finished first
        shutil.rmtree(partial, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(ensure(), file=sys.stdout)
