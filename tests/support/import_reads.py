"""What importing egressgate's modules reads from the process's surroundings (run as a script; prints JSON).

Why: the test fork server (tests/support/zygote.py) imports egressgate once and forks gateways from it. That
is only the same as exec'ing `egressgate` if no egressgate module captures, at import time, anything that
differs between two processes or two callers: environment variables, the working directory, random bytes,
the clock, the pid/uid, files. This records every such read made while egressgate's modules execute (with
third-party modules already imported, as in the server), with the egressgate module that made it;
tests/architecture/test_fork_safe_imports.py keeps the list to the reviewed exceptions.

Usage: python tests/support/import_reads.py [--package NAME] [MODULE...] (default: the fork server's modules)
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

READS: list[dict[str, str]] = []
PACKAGE = "egressgate"  # whose modules' reads are recorded (--package: the test's positive control)
PROBE_EXTENSIONS = (".py", ".pyc", ".so", ".pth")


# Reads by the import system itself (finding modules, installed distributions' metadata): they depend on
# sys.path and the installation, which the fork server shares with the console script, not on the caller.
IMPORT_MACHINERY = ("importlib._bootstrap", "importlib._bootstrap_external", "importlib.metadata", "zipimport")


def _note(what: str) -> None:
    """Record `what` against the innermost egressgate module on the stack, unless the import system (or
    nothing of egressgate) is between it and the read."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(IMPORT_MACHINERY):
            return
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            READS.append({"module": name, "read": what})
            return
        frame = frame.f_back


def _wrap(owner: Any, name: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _note(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}")
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


class _RecordingEnviron(type(os.environ)):  # type: ignore[misc]
    def __getitem__(self, key: str) -> str:
        _note(f"os.environ[{key!r}]")
        return super().__getitem__(key)

    def __iter__(self):
        _note("os.environ (iterated)")
        return super().__iter__()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open":
        path = str(args[0])
        if not path.endswith(PROBE_EXTENSIONS) and "/__pycache__/" not in path:
            _note(f"open({path})")
    elif event in ("os.listdir", "os.scandir", "glob.glob", "socket.gethostname", "os.chdir"):
        _note(f"{event}{args!r}")


def record(modules: list[str], preload: list[str]) -> list[dict[str, str]]:
    import importlib

    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:
            sys.modules.pop(name, None)
    os.environ.__class__ = _RecordingEnviron
    for owner, names in (
        (os, ("getcwd", "getcwdb", "urandom", "getpid", "getppid", "getuid", "geteuid", "getgid", "getlogin")),
        (time, ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "localtime", "gmtime")),
        (random, ("random", "randint", "randrange", "choice", "getrandbits", "randbytes", "shuffle", "uniform")),
        (socket, ("gethostname", "getfqdn")),
    ):
        for name in names:
            _wrap(owner, name)
    sys.addaudithook(_audit)
    for name in modules:
        importlib.import_module(name)
    return READS


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from tests.support.zygote_server import ENTRY_MODULES, _probe

    args = sys.argv[1:]
    if args[:1] == ["--package"]:
        PACKAGE, args = args[1], args[2:]
    targets = args or ENTRY_MODULES
    preload = [n for n in _probe(targets) if n != PACKAGE and not n.startswith(PACKAGE + ".")]
    print(json.dumps(record(targets, preload)))
