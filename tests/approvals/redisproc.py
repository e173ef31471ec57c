"""A real `redis-server` on a free loopback port in a tmp dir (never 6379, never one we did not start).

Stand-in until h12-redis's tests/support/redis.py is in main; same command line (appendonly on)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.support.env import free_port
from tests.support.launcher import stop_process

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisProcess:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        for _ in range(5):
            port = free_port()
            assert port != 6379
            self.proc = subprocess.Popen(
                [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                 "--appendonly", "yes", "--save", "", "--protected-mode", "yes", "--daemonize", "no",
                 "--logfile", str(self.dir / "redis.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                        s.sendall(b"PING\r\n")
                        if s.recv(64).startswith(b"+PONG"):
                            self.port = port
                            return
                except OSError:
                    time.sleep(0.02)
            stop_process(self.proc, timeout=5)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)
