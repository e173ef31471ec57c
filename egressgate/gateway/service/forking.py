"""Forking a gateway worker from the supervisor of `egressgate run --workers N` (workers.py), and the
supervisor's handle on it.

Why fork: an exec'd worker is a fresh interpreter that imports mitmproxy, aiohttp, aioquic, cryptography,
pydantic and egressgate again, ~1.2-1.6 CPU-seconds at every start and restart of every worker. The
supervisor imports all of it once (`preload`, before its event loop starts) and forks.

What a forked child must not share, and how `fork_worker` makes sure (`_shed`, before anything else runs):
* the supervisor's event loop: asyncio's at-fork hook (3.12+) forgets the running loop and the signal
  wakeup fd; `_shed` puts every signal handler back to what the process had when this module was imported
  (before any loop: the interpreter's own, plus whatever a sitecustomize installed), so the loop's
  SIGTERM/SIGINT/SIGHUP handlers are gone (they would swallow a signal until the worker installs its own: a
  PDEATHSIG SIGTERM lost in that window would orphan the worker);
* descriptors: a fork copies every fd, CLOEXEC or not, so `_shed` closes all but stdio, the inherited
  listeners and the worker's ready pipe: the loop's epoll fd and self-pipe, the var-dir lock, and above all
  the ready pipes of workers started concurrently (a sibling holding the write end of another worker's
  ready pipe would hide that worker's death from the supervisor until START_TIMEOUT). stdin becomes
  /dev/null (an exec'd worker's stdin was an empty pipe);
* the cyclic garbage collector: the parent's objects are frozen (gc.freeze) in the child, so an unreachable
  parent object holding one of the closed fd numbers is never finalized there (it would close whatever
  the child opened under that number since);
* random state: `random` reseeds itself after a fork, OpenSSL's generator detects the fork, and
  egressgate/audit/build.py re-keys its request ids (os.register_at_fork); other module-level state is kept
  fork-safe by tests/architecture/test_fork_safe_imports.py.

The child never returns into the supervisor's stack (it runs inside one of the supervisor's coroutines):
it ends as an interpreter ends (atexit handlers run, stdio flushed) with os._exit and the exit code an
exec'd interpreter would have had. A fork copies only the
calling thread; the supervisor runs none other (tests/gateway/test_worker_fork.py checks it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import importlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Collection

# What a worker imports before it serves (workers.worker_main -> cli.serve_or_fail -> app.serve).
WORKER_MODULES = ("egressgate.gateway.service.cli", "egressgate.gateway.service.app")
# The signal handlers before any event loop ran (`run` imports this module before it starts one).
_START_HANDLERS = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}


def preload() -> None:
    """Import what every worker needs, once, in the supervisor (before its loop starts), and freeze the
    heap: forked workers share those pages copy-on-write and their collector never walks them."""
    for name in WORKER_MODULES:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


def fork_worker(target: Callable[[], object], keep: Collection[int]) -> int:
    """Fork a child that sheds the parent's state (module docstring), runs `target()` in its own process
    group and exits with the code an interpreter running it would have; returns the child's pid. `keep`: the
    descriptors (besides 0-2) the child keeps."""
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
        with contextlib.suppress(Exception):
            stream.flush()
    enabled = gc.isenabled()
    gc.disable()  # no collection between the fork and the child's gc.freeze
    try:
        pid = os.fork()
    finally:
        if enabled:
            gc.enable()  # in the parent; the child decides below
    if pid:
        with contextlib.suppress(OSError):  # also done by the child: whichever runs first
            os.setpgid(pid, pid)
        return pid
    code = 1
    try:
        gc.freeze()
        if enabled:
            gc.enable()
        _shed(keep)
        code = _run(target)
    finally:
        os._exit(code)


def _shed(keep: Collection[int]) -> None:
    """In the child: own process group, a fresh interpreter's signal handling, only the kept descriptors."""
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    for sig, handler in _START_HANDLERS.items():
        if handler is not None and signal.getsignal(sig) is not handler:  # None: not set from Python
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    wanted = {0, 1, 2, *keep}
    for name in os.listdir("/proc/self/fd"):  # the listing's own fd is closed when listdir returns
        fd = int(name)
        if fd not in wanted:
            with contextlib.suppress(OSError):
                os.close(fd)


def _run(target: Callable[[], object]) -> int:
    """`target()` as an interpreter's main program: its exit code, a traceback for an uncaught exception,
    then the atexit handlers and stdio flushed (os._exit does neither). KeyboardInterrupt ends the process by
    SIGINT, as Python does."""
    interrupted = False
    try:
        target()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        interrupted, code = True, 130
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as at interpreter exit (e.g. a profiler's dump); they report their own errors
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


class Worker:
    """A forked worker as the supervisor sees it (the subset of asyncio.subprocess.Process it used): `pid`,
    `returncode` once reaped (negative: killed by that signal), `wait()`, `send_signal`, `kill`. The exit is
    seen through a pidfd in the running loop, or, where pidfd_open is unavailable (a kernel before 5.3, a
    seccomp profile without it), through SIGCHLD (no thread: the supervisor forks from a single thread). The
    pid is reaped only here, so it cannot be recycled while `send_signal` may still target it."""

    _by_sigchld: set[Worker] = set()  # the workers watched through SIGCHLD

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)  # a child not yet reaped: never a recycled pid
        except OSError:
            Worker._by_sigchld.add(self)
            self._loop.add_signal_handler(signal.SIGCHLD, Worker._sigchld)
            self._reap()  # it may have exited before the handler was set
        else:
            self._loop.add_reader(self._pidfd, self._reap)

    @staticmethod
    def _sigchld() -> None:
        for worker in list(Worker._by_sigchld):
            worker._reap()

    def _reap(self) -> None:
        if self.returncode is not None:
            return
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not ours to reap any more: cannot happen, but never spin on it
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
        Worker._by_sigchld.discard(self)
        self.returncode = os.waitstatus_to_exitcode(status)
        self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        """The exit code, once the worker exited (a cancelled waiter leaves the others waiting)."""
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
