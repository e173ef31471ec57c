"""gRPC server-streaming through the gateway vs direct (issue 21): wall time of one call that streams N
messages (default 1,000, 6 bytes each), median over runs; goal: at most 2x direct.

The world is the test harness's (tests/support/grpcworld.py): a real grpcio server over TLS on loopback,
a DNS server for `grpc.test` and a real `egressgate run` whose policy allows the streaming method. Each
run measures both paths once, interleaved (direct, then through the gateway), so both see the same
machine conditions. Channels are opened once and warmed with one call, so the figures are the stream
itself: per-message relaying through mitmproxy's HTTP/2 layers (and the gateway's per-chunk callables),
not connection setup or the CONNECT. A second figure includes a fresh channel per call (CONNECT, two TLS
handshakes, the decision) — what a short-lived agent process pays.

Usage: PYTHONPATH=$PWD .venv/bin/python loadtests/grpc_bench.py [--messages 1000] [--runs 9] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from tests.support.grpcworld import HOST, GrpcWorld, channel, method, open_grpc_world


def stream_once(ch: grpc.Channel, messages: int) -> float:
    """Seconds for one server-streaming call of `messages` messages, all received and checked."""
    start = time.perf_counter()
    got = 0
    for reply in method(ch, "Stream", streaming=True)(str(messages).encode(), timeout=60):
        assert reply == b"%06d" % got
        got += 1
    elapsed = time.perf_counter() - start
    assert got == messages, got
    return elapsed


def measure(w: GrpcWorld, messages: int, runs: int) -> dict[str, list[float]]:
    direct_target = f"127.0.0.1:{w.upstream.port}"
    roots_direct, roots_gw = w.ca.cert_pem.bytes(), w.gateway_roots()
    proxy = w.proxy_url()
    out: dict[str, list[float]] = {"direct": [], "gateway": [], "direct_fresh": [], "gateway_fresh": []}
    with channel(direct_target, roots_direct, authority=HOST) as direct, \
            channel(w.target, roots_gw, proxy=proxy) as via:
        stream_once(direct, 10)  # warm: connection, TLS, HTTP/2 settings
        stream_once(via, 10)
        for _ in range(runs):
            out["direct"].append(stream_once(direct, messages))
            out["gateway"].append(stream_once(via, messages))
            with channel(direct_target, roots_direct, authority=HOST) as fresh:
                out["direct_fresh"].append(stream_once(fresh, messages))
            with channel(w.target, roots_gw, proxy=proxy) as fresh:
                out["gateway_fresh"].append(stream_once(fresh, messages))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpc-bench-") as tmp, open_grpc_world(Path(tmp)) as w:
        times = measure(w, args.messages, args.runs)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"{args.messages} server-streamed messages, median of {args.runs} runs (ms):")
    for key in ("direct", "gateway", "direct_fresh", "gateway_fresh"):
        print(f"  {key:14} {med[key]:8.1f}   (min {min(times[key]) * 1000:.1f}, max {max(times[key]) * 1000:.1f})")
    print(f"  ratio warm channel: {med['gateway'] / med['direct']:.2f}x   "
          f"fresh channel: {med['gateway_fresh'] / med['direct_fresh']:.2f}x   (goal <= 2x)")
    if args.json:
        args.json.write_text(json.dumps({"messages": args.messages, "runs": args.runs, "seconds": times}, indent=1))


if __name__ == "__main__":
    main()
