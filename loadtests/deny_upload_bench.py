"""How fast a large denied upload is refused (issue 21 item 2): milliseconds from the moment the client has
sent its request head to the first byte of the gateway's answer, while the client keeps sending a 20 MiB
body as fast as the socket takes it (or, with `Expect: 100-continue`, waits). Goal: <= 50 ms.

The world is the tests' (tests/support/uploadworld.py): a real `egressgate run` on loopback, policy
`gw-bigdeny` (POST /allowed only), a counting upstream that must see no denied request head. Each sample
opens its connection first (the proxy's CONNECT and both TLS handshakes are not timed), sends the head,
starts the clock, then one thread writes body bytes whenever the socket is writable and reads as soon as
it is readable (select; one thread, so TLS sockets are never used from two threads). Kinds:

* `h1-cl`: HTTPS in a CONNECT tunnel, `Content-Length: 20 MiB`, the body streaming;
* `h1-chunked`: the same, chunked;
* `h1-expect`: `Content-Length: 20 MiB` + `Expect: 100-continue`, no body (the client waits);
* `plain-cl`: plain HTTP through the proxy (absolute form), 20 MiB streaming;
* `h2`: HTTP/2 in a CONNECT tunnel, HEADERS then DATA as the flow-control window allows;
* `allowed-small` (control): a 1 KiB POST to the allowed path in a tunnel, answered by the upstream.

Usage: PYTHONPATH=$PWD .venv/bin/python loadtests/deny_upload_bench.py [--runs 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.events

from tests.support.gwworld import auth, connect_tunnel, open_world, tls_wrap
from tests.support.uploadworld import HOST, UploadWorld, open_upload_world

BODY = 20 * 1024 * 1024
PIECE = 16384
KINDS = ["h1-cl", "h1-chunked", "h1-expect", "plain-cl", "h2", "allowed-small"]


def _open(uw: UploadWorld, sbx, kind: str) -> tuple[socket.socket, str, str]:
    """(connected socket, request target, extra head lines); the tunnel and TLS are set up here."""
    if kind == "plain-cl":
        return socket.create_connection(uw.gw.proxy, timeout=10), f"http://{HOST}:{uw.plain_port}/denied", auth(sbx)
    raw, answer = connect_tunnel(uw.gw, sbx, f"{HOST}:{uw.tls_port}")
    assert answer.startswith(b"HTTP/1.1 200"), answer
    return tls_wrap(raw, uw.gw, HOST), "/allowed" if kind == "allowed-small" else "/denied", ""


def _race(sock: socket.socket, body: bytes | None, chunked: bool) -> tuple[float, bytes]:
    """After the head: write `body` (None: nothing) whenever writable, stop at the first byte read.
    Returns (seconds to the first byte, what was read by then)."""
    start = time.perf_counter()
    sock.setblocking(False)
    view, off = memoryview(body or b""), 0
    while True:
        writing = off < len(view)
        readable, writable, _ = select.select([sock], [sock] if writing else [], [], 30)
        pending = isinstance(sock, ssl.SSLSocket) and sock.pending()
        if readable or pending:
            try:
                data = sock.recv(65536)
            except (ssl.SSLWantReadError, BlockingIOError):
                data = None
            if data is not None:
                return time.perf_counter() - start, data
        if not (readable or writable or pending):
            raise TimeoutError("no answer within 30 s")
        if writable and writing:
            piece = bytes(view[off : off + PIECE])
            frame = (b"%x\r\n" % len(piece) + piece + b"\r\n") if chunked else piece
            try:
                sent = sock.send(frame)
            except (ssl.SSLWantWriteError, BlockingIOError):
                continue
            if chunked:
                if sent != len(frame):  # a partial frame cannot be resumed cleanly in this simple loop
                    raise RuntimeError("partial chunked write")
                off += len(piece)
            else:
                off += sent


def h1_sample(uw: UploadWorld, sbx, kind: str) -> float:
    sock, target, extra = _open(uw, sbx, kind)
    size = 1024 if kind == "allowed-small" else BODY
    framing = "Transfer-Encoding: chunked" if kind == "h1-chunked" else f"Content-Length: {size}"
    expect = "Expect: 100-continue\r\n" if kind == "h1-expect" else ""
    head = f"POST {target} HTTP/1.1\r\nHost: {HOST}\r\n{extra}{framing}\r\n{expect}\r\n".encode()
    with sock:
        sock.sendall(head)
        body = None if kind == "h1-expect" else b"u" * size
        elapsed, first = _race(sock, body, chunked=kind == "h1-chunked")
    want = b"HTTP/1.1 200" if kind == "allowed-small" else b"HTTP/1.1 403"
    assert first.startswith(want[: len(first)]), first[:200]
    return elapsed


def h2_sample(uw: UploadWorld, sbx) -> float:
    raw, answer = connect_tunnel(uw.gw, sbx, f"{HOST}:{uw.h2_port}")
    assert answer.startswith(b"HTTP/1.1 200"), answer
    ctx = ssl.create_default_context(cafile=uw.gw.bundle)
    ctx.set_alpn_protocols(["h2"])
    sock = ctx.wrap_socket(raw, server_hostname=HOST)
    assert sock.selected_alpn_protocol() == "h2"
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    with sock:
        sock.sendall(conn.data_to_send())
        conn.send_headers(
            1,
            [
                (":method", "POST"),
                (":scheme", "https"),
                (":authority", f"{HOST}:{uw.h2_port}"),
                (":path", "/denied"),
                ("content-length", str(BODY)),
            ],
        )
        sock.sendall(conn.data_to_send())
        start = time.perf_counter()
        sock.setblocking(False)
        sent = 0
        while True:
            window = min(conn.local_flow_control_window(1), conn.max_outbound_frame_size, BODY - sent)
            if window > 0:
                conn.send_data(1, b"u" * window)
                sent += window
            out = conn.data_to_send()
            readable, _, _ = select.select([sock], [], [], 0 if out else 30)
            if out:
                sock.setblocking(True)
                sock.sendall(out)
                sock.setblocking(False)
            if readable or sock.pending():
                try:
                    data = sock.recv(65536)
                except ssl.SSLWantReadError:
                    continue
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived) and event.stream_id == 1:
                        assert dict(event.headers)[b":status"] == b"403"
                        return time.perf_counter() - start


def measure(uw: UploadWorld, runs: int) -> dict[str, list[float]]:
    sbx = uw.admit()

    def one(kind: str) -> float:
        return h2_sample(uw, sbx) if kind == "h2" else h1_sample(uw, sbx, kind)

    for kind in KINDS:  # warm: certificates, TLS contexts
        one(kind)
    mark = uw.seen.mark()
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(runs):
        for kind in KINDS:
            out[kind].append(one(kind))
    heads = [e for e in uw.seen.since(mark) if e["event"] == "start" and e["path"] != "/allowed"]
    assert heads == [], heads  # the upstream never saw a denied request
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deny-upload-") as tmp:
        for sub in ("world", "uw"):
            (Path(tmp) / sub).mkdir()
        with open_world(Path(tmp) / "world") as world, open_upload_world(world, Path(tmp) / "uw") as uw:
            times = measure(uw, args.runs)
    print(f"ms from the request head sent to the answer's first byte, {args.runs} runs each")
    print(f"  {'kind':14} {'p50':>7} {'p95':>7} {'max':>7}")
    for kind, values in times.items():
        ms = sorted(v * 1000 for v in values)
        p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
        print(f"  {kind:14} {statistics.median(ms):7.1f} {p95:7.1f} {ms[-1]:7.1f}")
    worst = max(statistics.median(times[k]) * 1000 for k in KINDS if k != "allowed-small")
    print(f"  worst median of the denied kinds: {worst:.1f} ms (goal <= 50 ms)")
    if args.json:
        args.json.write_text(json.dumps({"runs": args.runs, "seconds": times}, indent=1))


if __name__ == "__main__":
    main()
