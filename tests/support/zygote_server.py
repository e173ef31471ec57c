"""The fork server behind tests/support/zygote.py (run as a script, one per test process; read that module's
docstring first). It imports the modules `egressgate run` loads (ENTRY_MODULES: third-party first, then
egressgate's own, whose import-time reads tests/architecture/test_fork_safe_imports.py keeps safe), then
forks one child per request: the child becomes `egressgate ARGV...` (or `python -m egressgate ARGV...`)
with the caller's stdio, environment and working directory, as the console script (or -m) would, and the
server (its parent) reports its exit.

Single-threaded on purpose (a fork copies only the forking thread, and locks held by another thread would be
held forever in the child): one selector loop, SIGCHLD through a wakeup pipe.

Protocol (SOCK_SEQPACKET, one connection per child, JSON messages):
  client -> {"argv", "env", "cwd", "module", "netns"} + 3 fds (SCM_RIGHTS: stdin, stdout, stderr)
  server -> {"pid": N} ... later {"exit": CODE, "cpu": SECONDS}   (CODE as Popen.returncode: -SIG if killed)
  client -> {"signal": N}   (sent to the child only while it is unreaped: never to a recycled pid)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import selectors
import signal
import socket
import sys
import threading
import types

MAX_MSG = 1 << 20
# What `egressgate run` imports before it serves (and the console script's own modules).
ENTRY_MODULES = [
    "egressgate.cli",
    "egressgate.commands",
    "egressgate.gateway.service.cli",
    "egressgate.gateway.service.app",
]


def _preimport(names: list[str]) -> None:
    """Import what `egressgate run` would (the list comes from a probe in a throwaway child, see main)."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # a module that needs the real run's state is simply left to the child
            sys.modules.pop(name, None)


def _probe(entry_modules: list[str]) -> list[str]:
    """Names of the non-egressgate modules that importing `entry_modules` loads, in load order (a forked
    child imports them, so no egressgate module is ever loaded in the server itself)."""
    before = set(sys.modules)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        try:
            import importlib

            for m in entry_modules:
                importlib.import_module(m)
            new = [n for n in sys.modules if n not in before and n.split(".")[0] != "egressgate"]
            os.write(w, json.dumps(new).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b"[]")


class Server:
    """Accept requests, fork children, reap them and tell each requester its child's fate."""

    def __init__(self, listener: socket.socket, control: socket.socket) -> None:
        self.listener, self.control = listener, control
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler: the wakeup fd is written
        self.sel.register(listener, selectors.EVENT_READ, "accept")
        self.sel.register(control, selectors.EVENT_READ, "control")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "reap")
        self.children: dict[int, socket.socket | None] = {}  # pid -> its requester's connection
        self.by_conn: dict[socket.socket, int] = {}
        self.conns: set[socket.socket] = set()

    def serve(self) -> dict | None:
        """Run until the test process goes away (returns None); in a forked child, returns its request."""
        while True:
            for key, _ in self.sel.select():
                what = key.data
                if what == "accept":
                    conn, _ = self.listener.accept()
                    self.conns.add(conn)
                    self.sel.register(conn, selectors.EVENT_READ, "conn")
                elif what == "control":
                    if not self.control.recv(16):
                        return None
                elif what == "reap":
                    try:
                        while os.read(self.wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    self.reap()
                else:
                    request = self.on_message(key.fileobj)  # type: ignore[arg-type]
                    if request is not None:
                        return request

    def on_message(self, conn: socket.socket) -> dict | None:
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MSG, 3)
        except OSError:
            data, fds = b"", []
        if not data:
            self.sel.unregister(conn)
            pid = self.by_conn.pop(conn, None)
            if pid is not None and pid in self.children:
                self.children[pid] = None  # the handle was dropped: reap the child quietly later
            self.conns.discard(conn)
            conn.close()
            return None
        msg = json.loads(data)
        if "signal" in msg:
            pid = self.by_conn.get(conn)
            if pid is not None and pid in self.children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, int(msg["signal"]))
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.shed()
            msg["fds"] = fds
            return msg
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.by_conn[conn] = pid
        conn.send(json.dumps({"pid": pid}).encode())
        return None

    def shed(self) -> None:
        """In a forked child: close every socket and pipe of the server through its object (a raw close of
        the fds would leave objects that close a reused fd number when they are collected later)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sel.close()
        for conn in self.conns:
            conn.close()
        self.listener.close()
        self.control.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                self.by_conn.pop(conn, None)
                with contextlib.suppress(OSError):
                    conn.send(
                        json.dumps(
                            {"exit": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
                        ).encode()
                    )


def _enter_netns(name: str) -> None:
    """What `ip netns exec NAME` does before it execs (iproute2's netns_switch): join the namespace, take a
    mount namespace of its own (slave to the host's), mount a /sys that describes the new network namespace,
    and bind /etc/netns/NAME/* over /etc (a failed bind is only a warning there too)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ms_rdonly, ms_bind, ms_rec, ms_slave, mnt_detach = 1, 4096, 16384, 1 << 19, 2

    def mount(source: str, target: str, fstype: str, flags: int) -> int:
        return libc.mount(source.encode(), target.encode(), fstype.encode(), flags, None)

    with open(f"/run/netns/{name}") as fh:
        os.setns(fh.fileno(), os.CLONE_NEWNET)
    os.unshare(os.CLONE_NEWNS)
    if mount("", "/", "none", ms_slave | ms_rec) != 0:
        raise OSError(ctypes.get_errno(), f'"mount --make-rslave /" failed for netns {name}')
    flags = 0
    if libc.umount2(b"/sys", mnt_detach) != 0 and os.statvfs("/sys").f_flag & os.ST_RDONLY:
        flags = ms_rdonly
    if mount(name, "/sys", "sysfs", flags) != 0:
        raise OSError(ctypes.get_errno(), f"mount of /sys failed for netns {name}")
    etc = f"/etc/netns/{name}"
    if os.path.isdir(etc):
        for entry in sorted(os.listdir(etc)):
            if mount(f"{etc}/{entry}", f"/etc/{entry}", "none", ms_bind) != 0:
                print(f"Bind {etc}/{entry} -> /etc/{entry} failed", file=sys.stderr)


def _become(request: dict, script: str) -> None:
    """In the forked child: take the caller's stdio, environment, cwd and argv, and shed the server's state
    (its sockets, signal handlers, `random` state), so what runs next is the console script's process."""
    stdin, stdout, stderr = request["fds"]
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)  # inheritable, as a fresh process's stdio
    for fd in {stdin, stdout, stderr} - {0, 1, 2}:
        os.close(fd)
    if request.get("netns"):
        _enter_netns(request["netns"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv, module = request["argv"], request.get("module")
    main = types.ModuleType("__main__")
    if module:  # `python -m MODULE ARGS`: runpy sets argv[0] and fills __main__ as -m does
        args = argv[3:]
        sys.argv = ["-m", *args]
        sys.orig_argv = [sys.executable, "-m", module, *args]
        sys.path[0] = os.getcwd()
        name = os.path.basename(sys.executable)
    else:  # the console script
        sys.argv = [script, *argv[1:]]
        sys.orig_argv = [sys.executable, script, *argv[1:]]
        sys.path[0] = os.path.dirname(script)
        main.__file__ = script
        name = os.path.basename(script)
    sys.modules["__main__"] = main
    import random

    random.seed()
    try:  # the process name `pgrep egressgate` matches, as for the exec'd console script
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass

    # fresh stdio objects: buffering as Python chooses it at start-up for these fds
    def stream(fd: int, mode: str) -> io.BufferedIOBase:
        return open(fd, mode, closefd=False)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        stream(0, "rb"), encoding=sys.stdin.encoding, errors=sys.stdin.errors, line_buffering=False
    )
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        stream(1, "wb"),
        encoding=sys.stdout.encoding,
        errors=sys.stdout.errors,
        line_buffering=os.isatty(1),
        write_through="PYTHONUNBUFFERED" in os.environ,
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        stream(2, "wb"), encoding=sys.stderr.encoding, errors="backslashreplace", line_buffering=True
    )


def main() -> None:
    socket_path, control_fd, script = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    control = socket.socket(fileno=control_fd)
    sys.path[0] = os.path.dirname(script)  # the console script's, for whatever scans sys.path at import
    # third-party first, then egressgate (its import-time reads: tests/architecture/test_fork_safe_imports.py)
    _preimport(_probe(ENTRY_MODULES))
    _preimport(ENTRY_MODULES)
    if threading.active_count() != 1:
        raise SystemExit("zygote: an import started a thread; forking would copy a half-held lock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(64)
    import gc

    gc.collect()
    gc.freeze()  # the heap is shared copy-on-write with every child: keep the collector from touching it
    control.send(b"ready")
    request = Server(listener, control).serve()
    if request is None:
        return
    _become(request, script)
    module = request.get("module")
    del request
    if module:
        import runpy

        runpy._run_module_as_main(module, alter_argv=True)  # what `python -m` runs
        return
    from egressgate.cli import main as egressgate_main

    sys.exit(egressgate_main())


if __name__ == "__main__":
    main()
