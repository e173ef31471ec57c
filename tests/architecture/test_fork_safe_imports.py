"""Importing egressgate captures nothing a forked child would wrongly share with its parent or its caller.

The test fork server (tests/support/zygote.py) imports the modules `egressgate run` loads and forks gateways
from them, letting the caller's environment differ only in variables egressgate reads at run time (its own
EGRESSGATE_* and the proxy variables): the server's interpreter-level environment must equal the caller's
otherwise. That is the same as exec'ing the console script only while egressgate's module-level code reads
none of those variables, nor the working directory, the clock, the pid/uid or files, and draws no random
bytes a child would share. tests/support/import_reads.py records every such read while those modules
execute; this test keeps the list to the reviewed exceptions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import zygote

ROOT = Path(__file__).resolve().parents[2]
READS = ROOT / "tests" / "support" / "import_reads.py"

# Reviewed exceptions: (module, read) -> why it is safe in a forked child.
ALLOWED = {
    ("egressgate.audit.build", "os.urandom"): "the request-id key; re-drawn after fork (os.register_at_fork)",
}


def _reads(*args: str, env: dict[str, str] | None = None) -> list[dict[str, str]]:
    out = subprocess.run(
        [sys.executable, str(READS), *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _unsafe(reads: list[dict[str, str]]) -> set[tuple[str, str]]:
    """Reads a forked child could get wrong: any but an environment variable the fork server requires
    equal between itself and the caller (zygote.py compares all but the run-time ones)."""
    unsafe = set()
    for r in reads:
        key = (r["module"], r["read"])
        if key in ALLOWED:
            continue
        if r["read"].startswith("os.environ["):
            name = r["read"][len("os.environ['") : -2]
            if zygote._comparable({name: ""}):  # compared, so equal in server and caller
                continue
        unsafe.add(key)
    return unsafe


def test_the_fork_server_s_egressgate_modules_read_nothing_a_child_would_share() -> None:
    reads = _reads()
    assert reads, "the recorder saw nothing at all: it is broken (egressgate's pydantic models read env)"
    assert _unsafe(reads) == set()


def test_the_recorder_catches_each_kind_of_read(tmp_path: Path) -> None:
    """Positive control: a package whose import reads each kind of thing is reported, read by read."""
    pkg = tmp_path / "forkprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os, random, time\n"
        "from pathlib import Path\n"
        "FLAG = os.environ.get('EGRESSGATE_SOMETHING')\n"
        "HERE = Path.cwd()\n"
        "KEY = os.urandom(8)\n"
        "STARTED = time.time()\n"
        "SALT = random.random()\n"
        "TEXT = open('/etc/hostname').read() if os.path.exists('/etc/hostname') else open('/etc/passwd').read()\n"
    )
    reads = _reads("--package", "forkprobe", "forkprobe", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    found = {read.split("(")[0] for _, read in _unsafe(reads)}
    assert {
        "os.environ['EGRESSGATE_SOMETHING']",
        "os.getcwd",
        "os.urandom",
        "time.time",
        "random.random",
        "open",
    } <= found, found


FORK_TWICE = """
import os
from egressgate.audit.build import new_request_id

new_request_id()
for _ in range(2):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, new_request_id().encode())
        os._exit(0)
    os.close(w)
    print(os.read(r, 64).decode())
    os.waitpid(pid, 0)
"""


def test_a_forked_child_draws_its_own_request_ids() -> None:
    """The one allowed import-time draw: two children forked from one parent hand out different ids (in a
    single-threaded process of its own: the test process has threads, and fork there is deprecated)."""
    out = subprocess.run(
        [sys.executable, "-c", FORK_TWICE], capture_output=True, text=True, timeout=120, check=True, cwd=ROOT
    )
    ids = out.stdout.split()
    assert len(ids) == 2 and len(ids[0]) == 32 and ids[0] != ids[1], out.stdout
