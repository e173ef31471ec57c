"""Siblings of test_history_reads.py: the other per-request snapshot reads must not read a sandbox's whole
host history either — the raw-TCP decision inside an intercepted tunnel (gateway/layers/next_layer.py) and the
"N bytes remain" of a 429 (gateway/shared/ledger.py `remaining`). Both are sandbox-triggered at will; under Redis
each whole-history read is an SMEMBERS inside Redis's one thread (a cross-tenant stall).

Deterministic check: Redis's MONITOR stream (it shows the commands scripts run) has no SMEMBERS of a
`hosts:` key while the requests run (the periodic reconcile's SMEMBERS of the worker set is not one);
positive control: the same stream shows the SNAPSHOT scripts of these requests, and the requests really
take the paths under test (the deny reasons)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.gwworld import World, open_world, raw_bytes_in_tunnel, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.redis import RedisServer


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("a12-world")) as w:
        yield w


class Monitor:
    """Redis MONITOR on a raw socket, read by a thread until close()."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(b"MONITOR\r\n")
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        buf = b""
        try:
            while chunk := self.sock.recv(65536):
                buf += chunk
                *done, buf = buf.split(b"\r\n")
                self.lines.extend(line.decode(errors="replace") for line in done)
        except OSError:
            pass

    def close(self) -> list[str]:
        time.sleep(0.2)  # let the stream catch up
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)
        return self.lines


def test_raw_tcp_decisions_and_budget_refusals_never_read_the_history(world: World, tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        state = {"state": {"backend": "redis", "url": server.url, "key_prefix": server.prefix()}}
        gw = start_gateway(world, tmp_path / "gw", state)
        try:
            tcp_sbx, budget_sbx = gw.admit("gw-tcp"), gw.admit("gw-budget")
            for sbx in (tcp_sbx, budget_sbx):  # each sandbox's history has a host now
                with sbx.client() as c:
                    assert c.get(sbx.url("api.test", "/echo")).status_code == 200
            monitor = Monitor(server.port)
            for _ in range(3):
                status, _, body = raw_bytes_in_tunnel(gw, tcp_sbx, f"open.test:{world.tcp_port}")
                assert status == 403 and json.loads(body)["reason"] == "protocol_not_allowed"
                with budget_sbx.client() as c:
                    r = c.post(budget_sbx.url("api.test", "/upload"), content=b"x" * 5000)
                assert r.status_code == 429 and "remain" in r.json()["message"], r.text
            lines = monitor.close()
            snapshots = [line for line in lines if '"HMGET"' in line and ":ctr:" in line]
            assert len(snapshots) >= 6, lines[-20:]  # positive control: the snapshots ran, and MONITOR saw them
            whole = [line for line in lines if '"SMEMBERS"' in line and ":hosts:" in line]
            assert whole == [], f"{len(whole)} whole-history reads for 6 refusals: {whole[:3]}"
        finally:
            stop_gateway(gw)
