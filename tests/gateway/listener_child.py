"""A minimal process serving HTTP proxy requests with real mitmproxy on a listening socket it inherited.

`python tests/gateway/listener_child.py '{"proxy": FD}' patch|nopatch|asyncio`: rebuilds the socket from the
descriptor its parent passed (egressgate.gateway.service.listeners.inherit) and runs a mitmproxy master whose
regular mode names that socket's address. With `patch` (listeners.install_mitm, as a worker of
`run --workers N` does) mitmproxy serves the inherited socket; with `nopatch` it tries to bind the
address itself, which the parent holds (the control); with `asyncio` it serves the inherited socket with
asyncio's own server (the control of the fair-accept test). Every request is answered with this process's pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from mitmproxy import http, options
from mitmproxy import master as mitm_master
from mitmproxy.addons import next_layer, proxyserver
from mitmproxy.proxy import mode_servers

from egressgate.gateway.service import listeners


class AnswerWithPid:
    def request(self, flow: http.HTTPFlow) -> None:
        flow.response = http.Response.make(200, str(os.getpid()).encode())


class ReportServers:
    """One stderr line once mitmproxy has tried to start its proxy servers (Master.run awaits setup_servers
    before the `running` hook): `servers: [{"running": ..., "error": ...}]`. The control test waits for it (the
    unpatched child's bind failure) instead of a grace period: how long a start takes on a loaded machine is
    not a test's to guess."""

    def __init__(self, server: proxyserver.Proxyserver) -> None:
        self.server = server

    def running(self) -> None:
        states = [
            {"running": s.is_running, "error": str(s.last_exception) if s.last_exception else None}
            for s in self.server.servers
        ]
        print("servers: " + json.dumps(states), file=sys.stderr, flush=True)


async def main() -> None:
    socks = listeners.inherit(json.loads(sys.argv[1]))
    if sys.argv[2] in ("patch", "asyncio"):
        listeners.install_mitm([socks["proxy"]])
    if sys.argv[2] == "asyncio":  # the control: asyncio's own server on the same socket (burst accepts)
        shared = socks["proxy"]

        async def listen(self, host: str, port: int) -> list:
            return [await asyncio.start_server(self.handle_stream, sock=shared.dup())]

        mode_servers.AsyncioServerInstance.listen = listen  # type: ignore[method-assign]
    host, port = socks["proxy"].getsockname()[:2]
    opts = options.Options()
    master = mitm_master.Master(opts, with_termlog=False)
    server = proxyserver.Proxyserver()
    master.addons.add(server, next_layer.NextLayer(), AnswerWithPid(), ReportServers(server))
    opts.update(mode=[f"regular@{host}:{port}"])
    await master.run()


if __name__ == "__main__":
    asyncio.run(main())
