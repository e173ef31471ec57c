"""The supervisor of `run --workers N` forks its workers (egressgate/gateway/service/forking.py): a forked worker
shares none of the supervisor's loop, selector, signal handling, descriptors or random state, and exits with
the code an exec'd interpreter would have had. Each claim has its positive control: a bare os.fork() at the
same place in the same supervisor-like process (tests/gateway/fork_probe.py) does share them. The real
supervisor's side (restart, SIGHUP fan-out, PDEATHSIG, the worker's fds and process group) is in
tests/gateway/test_supervisor.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("fork_probe.py")
EXITS = {"return": 0, "exit3": 3, "exitmsg": 1, "raise": 1, "interrupt": -signal.SIGINT}


@pytest.fixture(scope="module")
def probe() -> dict:
    """Every scenario of fork_probe.py, in one supervisor-like process."""
    modes = ["shed", "raw", *(f"exit:{kind}" for kind in EXITS), "sigterm", "sigterm-raw", "no-pidfd"]
    # stdin a pipe (not /dev/null): the worker's own /dev/null stdin must come from fork_worker
    # SIGINT at its default: a process started with it ignored (a background job of a non-interactive shell,
    # as a CI script may run make) keeps it ignored, and so does a worker (as an exec'd one would): the
    # expectations below are a fresh interpreter's in a terminal
    res = subprocess.run([sys.executable, str(PROBE), *modes], input="", capture_output=True, text=True, timeout=180,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert res.returncode == 0, res.stderr[-3000:]
    return {**json.loads(res.stdout.splitlines()[-1]), "stderr": res.stderr}


def test_forked_worker_sheds_the_supervisors_loop_fds_signals_and_random_state(probe):
    sup, parent, child = probe["supervisor"], probe["shed"]["parent"], probe["shed"]["child"]
    assert parent["exit"] == 0
    # descriptors: only stdio and what it was told to keep (no epoll fd, self-pipe, lock, other pipes)
    assert child["fds"] == [], child
    assert child["stdin"] == "/dev/null"
    # signals: a fresh interpreter's handling (SIGTERM kills, SIGINT raises), no wakeup fd, no running loop
    # (and SIGUSR1 the Python handler set before the loop, which the loop had replaced: a sitecustomize's)
    assert child["handlers"] == {
        "SIGTERM": "SIG_DFL",
        "SIGINT": "default_int_handler",
        "SIGHUP": "SIG_DFL",
        "SIGUSR1": "python",
    }
    assert child["wakeup"] == -1 and child["running_loop"] is False
    assert child["own_loop"] != sup["loop"]  # asyncio.run in the child: a loop of its own
    # random state: its own `random` sequence and its own request-id key
    assert child["random"] != parent["random"] and child["id_key"] != parent["id_key"]
    assert child["own_pgrp"] is True and child["frozen"] > 0
    assert probe["threads"] == 1


def test_a_bare_fork_would_share_them(probe):
    """Positive control: what `fork_worker` sheds is really there after a plain fork in the running loop."""
    sup, child = probe["supervisor"], probe["raw"]["child"]
    inherited = set(child["fds"])
    assert {sup["selector"], sup["lock"], *sup["sibling"], *sup["self_pipe"]} <= inherited, probe["raw"]
    assert child["handlers"]["SIGTERM"] == "python" and child["handlers"]["SIGHUP"] == "python"
    assert child["own_pgrp"] is False and child["stdin"] != "/dev/null"


def test_worker_exit_codes_are_an_interpreters(probe):
    """Returned: 0; sys.exit(3): 3; sys.exit("msg"): 1 and the message; an exception: 1 and its traceback;
    KeyboardInterrupt: killed by SIGINT (as Python ends on an uncaught one)."""
    assert {kind: probe[f"exit:{kind}"]["exit"] for kind in EXITS} == EXITS
    assert "a message" in probe["stderr"] and "RuntimeError: boom" in probe["stderr"]
    # the atexit handlers ran at the child's end, as at an interpreter's (in the parent too: the control)
    for kind in ("return", "exit3", "raise"):
        assert f"atexit ran {probe[f'exit:{kind}']['pid']}" in probe["stderr"], probe["stderr"][-2000:]
    # the probe, the "shed" child, these five and no-pidfd's quick child (killed ones and bare forks: none)
    assert probe["stderr"].count("atexit ran") == 1 + 1 + len(EXITS) + 1


def test_sigterm_reaches_a_worker_before_it_has_handlers(probe):
    """The loop's SIGTERM handler is not inherited: a worker still starting dies of SIGTERM (PDEATHSIG and the
    supervisor's stop rely on it). Control: after a bare fork the copied handler swallows it."""
    assert probe["sigterm"] == {"exit": -signal.SIGTERM, "survived_sigterm": False}
    assert probe["sigterm-raw"] == {"exit": -signal.SIGKILL, "survived_sigterm": True}


def test_exits_are_seen_without_pidfd(probe):
    """Where pidfd_open fails, the supervisor learns of its workers' exits by SIGCHLD: the exit code of one,
    the SIGTERM of the other."""
    assert probe["no-pidfd"] == {"exits": [3, -signal.SIGTERM], "pidfd_used": False}
