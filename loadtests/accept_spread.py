"""How a burst of connections spreads over N asyncio worker processes: one inherited listening socket vs
one SO_REUSEPORT socket per worker.

    python -m loadtests.accept_spread [--workers 2] [--connections 32] [--rounds 5]

Why: `egressgate run --workers N` (gateway/service/listeners.py) binds ONE listening socket in the supervisor and
every worker serves it. asyncio accepts in a loop on each readiness event (up to `backlog` connections per
wake-up, base_events/selector_events `_accept_connection`), so when a client opens its keep-alive connections
in a burst, whichever worker wakes first can take most or all of them, and keep-alive keeps them there: the
other worker idles while the load runs. With SO_REUSEPORT each worker has its own socket and the kernel
hashes each connection to one of them. A third variant keeps the one shared socket but accepts one
connection per wake-up (asyncio's accept loop runs `backlog` times: start_server(..., backlog=1), then
listen() again so the queue keeps its size): a busy worker then takes fewer. This measures all three
with a trivial server (every worker counts the connections it accepted and holds them open) on
127.0.0.1, so the gateway's own cost plays no part. Each round: N workers start, a client opens
`--connections` connections at once, every worker reports its count. Printed: per round, the
connections per worker, busiest first.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import time


def _worker(sock: socket.socket | None, port: int, ready, report, accept_burst: int = 100) -> None:
    async def main() -> None:
        count = 0
        held: list = []

        def on_conn(reader, writer) -> None:
            nonlocal count
            count += 1
            held.append(writer)

        if sock is None:  # SO_REUSEPORT: this worker's own socket on the shared port
            server = await asyncio.start_server(on_conn, "127.0.0.1", port, reuse_port=True)
        else:
            # start_server re-listens with `backlog`, which is also how many connections asyncio accepts per
            # wake-up; listen() again afterwards so the shared queue keeps its size
            server = await asyncio.start_server(on_conn, sock=sock, backlog=accept_burst)
            sock.listen(1024)
        ready.send("up")
        await asyncio.get_running_loop().run_in_executor(None, report.recv)  # client is done
        report.send(count)
        server.close()

    asyncio.run(main())


def round_(mode: str, workers: int, connections: int) -> list[int]:
    ctx = mp.get_context("fork")
    shared = None
    if mode.startswith("shared"):
        shared = socket.create_server(("127.0.0.1", 0), backlog=1024)
        shared.setblocking(False)
        port = shared.getsockname()[1]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    procs, pipes = [], []
    for _ in range(workers):
        a, b = ctx.Pipe()
        c, d = ctx.Pipe()
        burst = 1 if mode == "shared-accept1" else 100
        p = ctx.Process(target=_worker, args=(shared, port, b, d, burst), daemon=True)
        p.start()
        procs.append(p)
        pipes.append((a, c))
    try:
        for a, _c in pipes:
            if not a.poll(20):
                raise RuntimeError("worker did not start")
            a.recv()
        time.sleep(0.2)
        conns = [socket.create_connection(("127.0.0.1", port), 5) for _ in range(connections)]
        time.sleep(0.5)  # let every worker accept what it will
        counts = []
        for _a, c in pipes:
            c.send("done")
            counts.append(c.recv() if c.poll(10) else -1)
        for s in conns:
            s.close()
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        if shared is not None:
            shared.close()
    return sorted(counts, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    for mode in ("shared", "shared-accept1", "reuseport"):
        rounds = [round_(mode, a.workers, a.connections) for _ in range(a.rounds)]
        print(f"{mode:14} connections per worker (busiest first), {a.rounds} rounds: "
              + "  ".join("/".join(map(str, r)) for r in rounds))


if __name__ == "__main__":
    main()
