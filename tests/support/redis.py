"""A real `redis-server` for the shared-state tests: a free loopback port, its own tmp dir, appendonly on.

Never port 6379 and never a Redis the test did not start: every test that needs Redis starts one of
these (session fixtures share one and give each test its own key prefix). `stop()` / `start()` again
keeps the port and the data dir, so a store built before the outage must recover by itself; `kill()` is
kill -9 (appendonly keeps what was fsynced: `appendfsync="always"` when a test needs every write).
Always tear it down in a finally block (`with RedisServer(tmp) as srv:` does).
"""

from __future__ import annotations

import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support.env import free_port
from tests.support.launcher import stop_process

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """One redis-server process (restartable on the same port and data dir)."""

    def __init__(self, directory: Path, *, appendfsync: str = "everysec", port: int | None = None,
                 password: str | None = None, unixsocket: bool = False) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.appendfsync = appendfsync
        self.password = password  # requirepass: clients must AUTH
        self.socket = self.dir / "redis.sock" if unixsocket else None
        self.port = port or 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.socket is not None
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.socket}"

    def prefix(self) -> str:
        """A fresh key prefix: tests sharing one server never see each other's keys."""
        return f"egtest-{secrets.token_hex(4)}:"

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        attempts = 1 if self.port else 5  # a merely-free port can be taken before redis binds it
        for _ in range(attempts):
            port = self.port or free_port()
            assert port != 6379
            self.proc = subprocess.Popen(
                [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                 "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "",
                 "--protected-mode", "yes", "--daemonize", "no", "--logfile", str(self.dir / "redis.log"),
                 *(["--requirepass", self.password] if self.password else []),
                 *(["--unixsocket", str(self.socket), "--unixsocketperm", "700"] if self.socket else [])],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            if self._wait_ready(port, timeout):
                self.port = port
                return self
            stop_process(self.proc, timeout=5)
        log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not start:\n{log}")

    def _wait_ready(self, port: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith(b"+PONG") or (self.password and reply.startswith(b"-NOAUTH")):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        """SIGTERM (redis writes its AOF and exits), then SIGKILL."""
        if self.proc is not None:
            stop_process(self.proc, timeout=10)

    def kill(self) -> None:
        """kill -9: no shutdown handling; what was not fsynced to the AOF is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
