"""Redis's MONITOR on a connection of its own: every command Redis runs, in the order it ran them, for
tests that count what a gateway sends to its state store. Commands a Lua script runs are listed with the
client `lua` (they are not round trips)."""

from __future__ import annotations

import re
import secrets
import socket
import threading

from tests.support.waiting import wait_for

QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')  # MONITOR's "word" "word" ...


class Monitor:
    """MONITOR on a connection of its own; a thread reads what Redis runs into `lines`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(b"MONITOR\r\n")
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            buf += data
            *done, buf = buf.split(b"\r\n")
            with self.lock:
                self.lines.extend(line.decode(errors="replace") for line in done)

    def mark(self) -> str:
        """A sentinel command sent on another connection; returns when MONITOR has shown it. Redis runs
        commands one at a time, so everything it ran before the sentinel is in `lines` before it."""
        token = secrets.token_hex(8)
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(f"ECHO {token}\r\n".encode())
            s.recv(100)
        assert wait_for(lambda: any(token in line for line in self.snapshot()), timeout=10)
        return token

    def snapshot(self) -> list[str]:
        with self.lock:
            return list(self.lines)

    def between(self, start: str, end: str) -> list[tuple[str, list[str]]]:
        """(client, words) of every command Redis ran between two marks (the sentinels left out); the
        client is `lua` for a command a script ran, else the sender's address."""
        lines = self.snapshot()
        first = next(i for i, line in enumerate(lines) if start in line)
        last = next(i for i, line in enumerate(lines) if end in line)
        out = []
        for line in lines[first + 1 : last]:
            if "[" not in line or "] " not in line:
                continue
            client = line[line.index("[") + 1 : line.index("] ")].split(" ", 1)[-1]  # "0 127.0.0.1:5555"
            words = QUOTED.findall(line[line.index("] ") + 2 :])
            if words:
                out.append((client, words))
        return out

    def close(self) -> None:
        self.sock.close()
