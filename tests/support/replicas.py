"""Two real gateways on one Redis (replicas), and a stream held open through a gateway.

Shared by tests/state (test_gateway_redis.py), tests/approvals (test_redis_replicas.py) and
tests/gateway (test_lifecycle.py): the replica pair is started and torn down the same way everywhere
(the second gateway is stopped even when the first one's teardown fails), and a sandbox is pointed at
the other replica by rewriting its proxy URL, so a request really goes through that replica's port."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.gwworld import Gateway, Sandbox, World
from tests.support.launcher import start_all, stop_gateway
from tests.support.redis import RedisServer
from tests.support.waiting import wait_for

StartGateway = Callable[[World, Path, dict], Gateway]


@contextlib.contextmanager
def gateway_pair(start: StartGateway, world: World, redis_server: RedisServer,
                 dirs: Callable[[str], Path]) -> Iterator[tuple[Gateway, Gateway]]:
    """Gateways `a` and `b` started by `start(world, dir, extra_config)` on `redis_server` under one
    fresh key prefix (so both see the same sandboxes); `dirs(name)` makes each one's directory."""
    state = {"state": {"backend": "redis", "url": redis_server.url, "key_prefix": redis_server.prefix()}}
    a, b = start_all([lambda: start(world, dirs("gw-a"), state), lambda: start(world, dirs("gw-b"), state)],
                     stop_gateway)  # at once: two replicas may start together, and it halves the wait
    try:
        yield a, b
    finally:
        try:
            stop_gateway(b)
        finally:
            stop_gateway(a)


def through(sbx: Sandbox, gw: Gateway) -> Sandbox:
    """The same sandbox credentials, pointed at `gw`'s proxy port (another replica's, or its own)."""
    url = sbx.proxy_url.replace(f":{sbx.gw.proxy[1]}", f":{gw.proxy[1]}")
    assert gw is sbx.gw or url != sbx.proxy_url  # the proxy URL really names the other replica
    return Sandbox(id=sbx.id, token=sbx.token, proxy_url=url, env=sbx.env, gw=gw)


@dataclass
class HeldStream:
    """A server-sent-events stream (the world's /sse upstream, held open until released) read in a
    thread: `lines` seen, when `first` arrived, how it `end`ed (eof or the httpx error's name) and when (`t`)."""

    thread: threading.Thread
    outcome: dict = field(default_factory=dict)

    def wait_first(self, timeout: float = 30) -> bool:
        return wait_for(lambda: "first" in self.outcome, timeout=timeout)

    def join(self, timeout: float = 5) -> bool:
        """True when the stream has ended within `timeout`."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


def hold_sse(sbx: Sandbox, key: str, hold: float | None = None) -> HeldStream:
    """Open `sbx`'s stream to sse.test/sse?key=KEY through `sbx`'s proxy and keep reading it.

    With `hold`, the upstream ends the stream on its own only after `hold` seconds and the client never
    times out reading: only a cut (by the gateway) or that end can end it, so a test that asserts a cut
    needs no bound on how soon it came (a loaded machine may take seconds)."""
    outcome: dict = {}
    params = {"key": key} if hold is None else {"key": key, "hold": str(hold)}
    client_kw = {} if hold is None else {"timeout": httpx.Timeout(30, read=None)}

    def stream() -> None:
        try:
            with sbx.client(**client_kw) as c, c.stream("GET", sbx.url("sse.test", "/sse"), params=params) as r:
                for line in r.iter_lines():
                    if line:
                        outcome.setdefault("lines", []).append(line)
                        if line == "data: first":
                            outcome["first"] = time.monotonic()
            outcome["end"] = "eof"
        except httpx.HTTPError as exc:
            outcome["end"] = type(exc).__name__
        outcome["t"] = time.monotonic()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    return HeldStream(t, outcome)
