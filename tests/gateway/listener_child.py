"""A minimal process serving HTTP proxy requests with real mitmproxy on a listening socket it inherited.

`python tests/gateway/listener_child.py '{"proxy": FD}' patch|nopatch`: rebuilds the socket from the
descriptor its parent passed (egressgate.gateway.listeners.inherit) and runs a mitmproxy master whose
regular mode names that socket's address. With `patch` (listeners.install_mitm, as a worker of
`run --workers N` does) mitmproxy serves the inherited socket; with `nopatch` it tries to bind the
address itself, which the parent holds (the control). Every request is answered with this process's pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from mitmproxy import http, options
from mitmproxy import master as mitm_master
from mitmproxy.addons import next_layer, proxyserver

from egressgate.gateway import listeners


class AnswerWithPid:
    def request(self, flow: http.HTTPFlow) -> None:
        flow.response = http.Response.make(200, str(os.getpid()).encode())


async def main() -> None:
    socks = listeners.inherit(json.loads(sys.argv[1]))
    if sys.argv[2] == "patch":
        listeners.install_mitm([socks["proxy"]])
    host, port = socks["proxy"].getsockname()[:2]
    opts = options.Options()
    master = mitm_master.Master(opts, with_termlog=False)
    master.addons.add(proxyserver.Proxyserver(), next_layer.NextLayer(), AnswerWithPid())
    opts.update(mode=[f"regular@{host}:{port}"])
    await master.run()


if __name__ == "__main__":
    asyncio.run(main())
