"""A supervisor-like process for tests/gateway/test_worker_fork.py (run as a script: forking the pytest worker
itself would copy its execnet threads). Inside a running asyncio loop with SIGTERM/SIGINT/SIGHUP handlers, a
held file lock and another pipe open, like Supervisor.run, it forks a child and prints one JSON line: what
the parent saw and what the child reported about itself.

argv[1:] are the scenarios, run one after the other in that process:
  shed      fork with egressgate's `fork_worker`; the child reports its state (fds, signal handlers, loop,
            random, request-id key, process group, gc) and then runs a loop of its own;
  raw       the positive control: a bare os.fork() at the same place, the child reporting the same state;
  exit:X    fork_worker with a target that returns (X=return), raises SystemExit(3) (X=exit3), SystemExit("msg")
            (X=exitmsg), RuntimeError (X=raise) or KeyboardInterrupt (X=interrupt): the parent reports
            Worker.wait()'s exit code;
  sigterm   fork_worker with a target that sleeps; the parent sends SIGTERM and reports the exit code (a
            handler copied from the loop would swallow it);
  sigterm-raw  the same with a bare os.fork() (the control: the copied handler swallows SIGTERM; the parent
            SIGKILLs it after a few seconds).
"""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import gc
import json
import os
import random
import signal
import sys
import tempfile
import time

# before the loop, as a sitecustomize would: a worker keeps this handler and runs atexit handlers at its end
signal.signal(signal.SIGUSR1, lambda *_: None)
atexit.register(lambda: print(f"atexit ran {os.getpid()}", file=sys.stderr, flush=True))

from egressgate.audit import build  # noqa: E402
from egressgate.gateway.service.forking import Worker, fork_worker  # noqa: E402


def child_state(keep: set[int]) -> dict:
    fds = sorted(fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_open(fd))  # not the listing's own
    handlers = {name: _handler(getattr(signal, name)) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")}
    wakeup = signal.set_wakeup_fd(-1)
    running = asyncio._get_running_loop()

    async def own_loop() -> int:
        return id(asyncio.get_running_loop())  # the parent's loop object still exists here: never the same id

    own_selector = asyncio.run(own_loop())
    return {
        "fds": [fd for fd in fds if fd not in keep],
        "stdin": os.path.realpath("/proc/self/fd/0"),
        "handlers": handlers,
        "wakeup": wakeup,
        "running_loop": running is not None,
        "own_loop": own_selector,
        "random": random.getrandbits(64),
        "id_key": build._ID_KEY.hex(),
        "own_pgrp": os.getpgid(0) == os.getpid(),
        "frozen": gc.get_freeze_count(),
    }


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _handler(sig: int) -> str:
    h = signal.getsignal(sig)
    if h is signal.default_int_handler:
        return "default_int_handler"
    return {signal.SIG_DFL: "SIG_DFL", signal.SIG_IGN: "SIG_IGN"}.get(h, "python")  # type: ignore[arg-type]


async def scenario(mode: str) -> dict:
    report_r, report_w = os.pipe()
    keep = {0, 1, 2, report_w}

    def report() -> None:
        os.write(report_w, json.dumps(child_state(keep)).encode())
        os.close(report_w)

    if mode in ("shed", "raw"):
        pid = fork_worker(report, keep=[report_w]) if mode == "shed" else _bare_fork(report)
        worker = Worker(pid)
        os.close(report_w)
        seen = {"random": random.getrandbits(64), "id_key": build._ID_KEY.hex()}
        data = await _read_all(report_r)
        seen["exit"] = await asyncio.wait_for(worker.wait(), 60)
        return {"parent": seen, "child": json.loads(data)}
    os.close(report_r)
    os.close(report_w)
    if mode.startswith("exit:"):
        kind = mode.split(":", 1)[1]

        def target() -> None:
            if kind == "exit3":
                sys.exit(3)
            if kind == "exitmsg":
                sys.exit("a message")
            if kind == "raise":
                raise RuntimeError("boom")
            if kind == "interrupt":
                raise KeyboardInterrupt

        worker = Worker(fork_worker(target, keep=[]))
        return {"exit": await asyncio.wait_for(worker.wait(), 60), "pid": worker.pid}
    assert mode in ("sigterm", "sigterm-raw"), mode
    ready_r, ready_w = os.pipe()

    def sleeper() -> None:
        os.close(ready_w)  # the child runs: the parent may signal it
        time.sleep(60)

    worker = Worker(fork_worker(sleeper, keep=[ready_w]) if mode == "sigterm" else _bare_fork(sleeper))
    os.close(ready_w)
    await _read_all(ready_r)  # EOF once the child closed its copy
    worker.send_signal(signal.SIGTERM)
    try:
        return {"exit": await asyncio.wait_for(worker.wait(), 5), "survived_sigterm": False}
    except TimeoutError:
        worker.kill()
        return {"exit": await worker.wait(), "survived_sigterm": True}


def _bare_fork(target) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            target()
        finally:
            os._exit(0)
    return pid


async def without_pidfd() -> dict:
    """Where pidfd_open fails (an old kernel, a seccomp profile without it) the exits arrive by SIGCHLD: two
    workers at once, one exiting 3, one killed by SIGTERM."""
    real = os.pidfd_open

    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")  # ENOSYS, as a kernel before 5.3 answers

    os.pidfd_open = refused  # type: ignore[assignment]
    try:
        ready_r, ready_w = os.pipe()

        def sleeper() -> None:
            os.close(ready_w)
            time.sleep(60)

        quick = Worker(fork_worker(lambda: sys.exit(3), keep=[]))
        slow = Worker(fork_worker(sleeper, keep=[ready_w]))
        os.close(ready_w)
        await _read_all(ready_r)
        slow.send_signal(signal.SIGTERM)
        codes = await asyncio.wait_for(asyncio.gather(quick.wait(), slow.wait()), 60)
        return {"exits": codes, "pidfd_used": quick._pidfd is not None or slow._pidfd is not None}
    finally:
        os.pidfd_open = real


async def main(modes: list[str]) -> dict:
    """Every scenario in one process (one interpreter start for the whole test module), in a loop set up as
    Supervisor.run sets up its own."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        loop.add_signal_handler(sig, stop.set)
    lock = os.open(tempfile.mkstemp()[1], os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(lock, fcntl.LOCK_EX)
    sibling_r, sibling_w = os.pipe()  # another worker's ready pipe
    state = {
        "loop": id(loop),
        "selector": loop._selector.fileno(),  # type: ignore[attr-defined]
        "self_pipe": [loop._ssock.fileno(), loop._csock.fileno()],  # type: ignore[attr-defined]
        "lock": lock,
        "sibling": [sibling_r, sibling_w],
    }
    out: dict = {"supervisor": state}
    for mode in modes:
        out[mode] = await (without_pidfd() if mode == "no-pidfd" else scenario(mode))
    out["threads"] = len(os.listdir("/proc/self/task"))  # every fork above came from a single thread
    return out


async def _read_all(fd: int) -> bytes:
    """Everything until EOF, read in the loop (no executor thread: the probe forks from one thread)."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    done = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if chunk:
            chunks.append(chunk)
        elif not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return b"".join(chunks)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))))
