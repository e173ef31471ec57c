"""Start `egressgate ...` processes without paying for their imports each time: a per-test-process fork server.

Why: the suite is CPU-bound on a 2-core machine, and a gateway start spends ~1 CPU-s importing mitmproxy,
aiohttp, aioquic, pydantic, cryptography and egressgate's own pydantic models. The server
(tests/support/zygote_server.py, one per test process, started on first use) imports what `egressgate run`
imports once and forks a child per start; the child takes the caller's argv, environment, cwd and stdio fds
(sent over a unix socket, SCM_RIGHTS) and runs the console script's `egressgate.cli.main()`. Nothing of
egressgate has run in the server but module-level code, and tests/architecture/test_fork_safe_imports.py
keeps that code from capturing anything a child would wrongly share (the environment variables allowed to
differ, the cwd, the clock, random bytes, files); the one random draw, audit/build.py's request-id key, is
re-drawn after a fork.

What the child is NOT: an exec'd process. Its interpreter was started with the server's environment, so
anything read at interpreter or third-party import time (PYTHON*, locale, SSL_CERT_*, ...) is the server's.
`popen` therefore forks only when the caller's environment equals the server's except for variables in
FORK_SAFE_ENV (read by egressgate at run time only) and otherwise runs the real command; it also runs the real
command when EGRESSGATE_TEST_ZYGOTE=0 (the switch to rule the fork server out when a test fails oddly).
Two differences remain. /proc/PID/environ shows the environment a process was exec'd with, so a forked
child's shows the server's (its `os.environ`, what egressgate reads, is the caller's); only
tests/runtimes/test_secrets_off_argv.py reads every /proc/*/environ, for secrets no gateway is started
with. And forked children share the server's string-hash seed (an exec'd process draws its own): the
iteration order of str-keyed sets is the same in every gateway one test process forks.
tests/test_zygote.py compares a forked gateway with an exec'd one.

`ZygoteProcess` is the Popen subset the harnesses use (pid, stdout, poll, wait, send_signal, terminate,
kill, returncode, context manager). The server is the child's parent: it reaps it and reports the exit
status and the child's CPU (added to ZYGOTE_CPU: tests/support/cpu_usage.py counts it as children CPU).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

SERVER = Path(__file__).with_name("zygote_server.py")
EGRESSGATE = str(Path(sys.executable).with_name("egressgate"))  # the console script
SWITCH = "EGRESSGATE_TEST_ZYGOTE"
# Read by egressgate (or the libraries it calls) when it runs, never at import time.
FORK_SAFE_ENV = (
    "NO_PROXY",
    "no_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "HTTPS_PROXY",
    "https_proxy",
    "ALL_PROXY",
    "all_proxy",
    "PYTEST_CURRENT_TEST",
    SWITCH,
)
FORK_SAFE_PREFIXES = ("EGRESSGATE_",)

ZYGOTE_CPU = 0.0  # CPU seconds of reaped zygote children (the server reaps them, so RUSAGE_CHILDREN misses it)
FORKED = 0  # how many starts went through the server (a test asserts the harness really uses it)
_lock = threading.Lock()
_server: dict[int, _Server | None] = {}  # pid of the test process -> its server (None: failed to start)


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in FORK_SAFE_ENV and not k.startswith(FORK_SAFE_PREFIXES)}


class _Server:
    def __init__(self, script: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="egressgate-zygote-")
        atexit.register(shutil.rmtree, self.dir, True)  # its socket and log; the server ends with this process
        self.path = os.path.join(self.dir, "s")
        self.control, theirs = socket.socketpair()
        self.env = dict(os.environ)
        self.script = script
        log = open(os.path.join(self.dir, "server.log"), "w")  # noqa: SIM115 - the server's own stderr
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), self.path, str(theirs.fileno()), script],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=self.env,
            cwd="/",
        )
        theirs.close()
        log.close()
        self.control.settimeout(300)
        if self.control.recv(16) != b"ready":
            raise RuntimeError(f"zygote server did not start: {Path(self.dir, 'server.log').read_text()[-2000:]}")


def _get_server(script: str) -> _Server | None:
    with _lock:
        if os.getpid() not in _server:
            try:
                _server[os.getpid()] = _Server(script)
            except (OSError, RuntimeError) as exc:
                print(f"zygote: not used ({exc})", file=sys.stderr)
                _server[os.getpid()] = None
        return _server[os.getpid()]


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


class ZygoteProcess:
    """A forked `egressgate` child, driven like a `subprocess.Popen`."""

    def __init__(
        self,
        server: _Server,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        stdin: IO[Any] | int | None,
        stdout: IO[Any] | int | None,
        stderr: IO[Any] | int | None,
        text: bool,
        netns: str | None = None,
    ) -> None:
        self.args = argv
        self.returncode: int | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        self.stdin = None
        self._lock = threading.Lock()
        close_after: list[int] = []
        theirs: list[int] = []
        for stream, default, mode in ((stdin, 0, "w"), (stdout, 1, "r"), (stderr, 2, "r")):
            if stream is None:
                theirs.append(default)
            elif stream == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                theirs.append(fd)
                close_after.append(fd)
            elif stream == subprocess.PIPE:
                if mode == "w":
                    raise ValueError("stdin=PIPE is not supported by the zygote")
                r, w = os.pipe()
                theirs.append(w)
                close_after.append(w)
                pipe = open(r, "r" if text else "rb")  # noqa: SIM115 - the caller's, as Popen's
                if default == 1:
                    self.stdout = pipe
                else:
                    self.stderr = pipe
            elif isinstance(stream, int):
                theirs.append(stream)
            else:
                theirs.append(stream.fileno())
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._conn.connect(server.path)
            request = {"argv": argv, "env": env, "cwd": cwd, "module": _module_of(argv), "netns": netns}
            socket.send_fds(self._conn, [json.dumps(request).encode()], theirs)
            self.pid = json.loads(self._conn.recv(4096))["pid"]
        finally:
            for fd in close_after:
                os.close(fd)

    def _receive(self, timeout: float | None) -> None:
        """Wait up to `timeout` (None: forever, 0: not at all) for the server's exit report."""
        with self._lock:
            if self.returncode is not None:
                return
            self._conn.settimeout(timeout)
            try:
                data = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return
            finally:
                self._conn.settimeout(None)
            if not data:
                raise RuntimeError(f"zygote server went away before child {self.pid} exited")
            global ZYGOTE_CPU
            msg = json.loads(data)
            ZYGOTE_CPU += msg["cpu"]
            self.returncode = msg["exit"]
            self._conn.close()

    def poll(self) -> int | None:
        self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._receive(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                self._conn.send(json.dumps({"signal": int(sig)}).encode())

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ZygoteProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def _module_of(argv: list[str]) -> str | None:
    """The module `python -m` runs ("egressgate") for `python -m egressgate ...` with this interpreter."""
    return "egressgate" if argv[:3] == [sys.executable, "-m", "egressgate"] else None


def popen(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdin: IO[Any] | int | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    text: bool = False,
    netns: str | None = None,
) -> ZygoteProcess | subprocess.Popen:
    """`subprocess.Popen(argv, ...)` for an `egressgate` command (the console script, or `python -m
    egressgate` with this interpreter; `netns`: inside that network namespace, as `ip netns exec NETNS ARGV`
    runs it), forked from
    the zygote when that is indistinguishable to the command (see the module docstring), exec'd otherwise."""
    env = dict(os.environ if env is None else env)
    wanted = enabled() and env.get(SWITCH, "1") != "0" and stdin != subprocess.PIPE
    server = _get_server(EGRESSGATE) if wanted else None
    ours = server is not None and (argv[:1] == [server.script] or _module_of(argv) is not None)
    if server is None or not ours or _comparable(env) != _comparable(server.env):
        command = ["ip", "netns", "exec", netns, *argv] if netns else argv
        return subprocess.Popen(command, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text)
    global FORKED
    FORKED += 1
    cwd = str(Path(cwd or os.getcwd()).absolute())
    return ZygoteProcess(server, argv, env, cwd, stdin, stdout, stderr, text, netns)
