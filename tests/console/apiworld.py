"""The console API's test world: the control-API loopback world (real upstreams, real `egressgate run`,
tests/control_api/harness.py) and an httpx client per console session, as a browser would send them.

`ConsoleClient` keeps the session cookie and sends the console's own Origin and the CSRF token on
POST/DELETE unless a test says otherwise (`origin=None`, `csrf=None`, or wrong values).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

from tests.control_api.harness import start_control_gateway
from tests.support.gwworld import Gateway, World

UNSET: Any = object()
# the console is plain HTTP, yet every httpx client builds a TLS context and loads certifi's bundle into it
# (~16 ms of CPU each, tests/control_api/harness.py): one unused context for every client instead
_UNUSED_TLS = ssl.create_default_context()


def role_token(gw: Gateway, role: str) -> str:
    return (gw.var / f"console-{role}.token").read_text().strip()


class ConsoleClient:
    def __init__(self, gw: Gateway, role: str | None = None) -> None:
        self.gw = gw
        self.origin = f"http://{gw.admin}"
        self.http = httpx.Client(base_url=self.origin, timeout=10, trust_env=False, verify=_UNUSED_TLS)
        self.csrf = ""
        if role is not None:
            self.login(role)

    def login(self, role: str) -> httpx.Response:
        res = self.post("/ui/api/login", json={"token": role_token(self.gw, role)}, csrf=None)
        assert res.status_code == 200, res.text
        self.csrf = res.json()["csrf"]
        return res

    def request(self, method: str, path: str, *, origin: str | None = UNSET, csrf: str | None = UNSET,
                **kw: Any) -> httpx.Response:
        headers = dict(kw.pop("headers", {}))
        if method in ("POST", "DELETE"):
            origin = self.origin if origin is UNSET else origin
            csrf = self.csrf if csrf is UNSET else csrf
            if origin is not None:
                headers["Origin"] = origin
            if csrf is not None:
                headers["X-CSRF-Token"] = csrf
        return self.http.request(method, path, headers=headers, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return self.request("POST", path, **kw)

    def delete(self, path: str, **kw: Any) -> httpx.Response:
        return self.request("DELETE", path, **kw)

    def close(self) -> None:
        self.http.close()


def start_console_gateway(world: World, tmp: Path) -> Gateway:
    return start_control_gateway(world, tmp)


class LiveStream:
    """`GET /ui/api/live` read in a thread, as EventSource would: parsed events in `events` as
    (event name, data text, monotonic arrival time); `ready` once the server said it is subscribed."""

    def __init__(self, client: ConsoleClient, **params: str) -> None:
        import threading

        self.events: list[tuple[str, str, float]] = []
        self.ready = threading.Event()
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self._client = httpx.Client(base_url=client.origin, timeout=httpx.Timeout(10, read=30), trust_env=False,
                                    cookies=client.http.cookies, verify=_UNUSED_TLS)
        self._thread = threading.Thread(target=self._run, args=(params,), daemon=True)
        self._thread.start()

    def _run(self, params: dict[str, str]) -> None:
        import time

        try:
            with self._client.stream("GET", "/ui/api/live", params=params) as res:
                self.status, self.headers = res.status_code, res.headers
                if res.status_code != 200:
                    self.ready.set()
                    return
                name, data = "message", []
                for line in res.iter_lines():
                    if line == "":
                        if data:
                            self.events.append((name, "\n".join(data), time.monotonic()))
                            if name == "ready":
                                self.ready.set()
                        name, data = "message", []
                    elif line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip())
        except httpx.HTTPError:
            pass
        finally:
            self.ready.set()

    def records(self) -> list[tuple[dict, float]]:
        import json

        return [(json.loads(d), t) for n, d, t in list(self.events) if n == "record"]

    def close(self) -> None:
        """Stop listening. The reader thread (a daemon) ends when the server ends the stream (logout,
        gateway stop): an httpx read blocked in another thread cannot be interrupted from here."""
        self._client.close()
