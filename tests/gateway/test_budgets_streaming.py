"""Outbound byte budgets exact to the byte (Content-Length, chunked, websocket), streaming (large bodies,
SSE first event before the upstream finishes).

Counting rule (docs in gateway/pipeline/budgets.py): request head = HTTP/1.1 serialization of what goes upstream
(for a raw HTTP/1.1 client that is exactly the bytes of its head), body = payload bytes (de-chunked).
`gw-budget` has outbound_bytes_max: 4000.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time

import aiohttp

from tests.support.gwworld import connect_tunnel, tls_wrap
from tests.support.http1 import read_reply

LIMIT = 4000


def cl_head(port: int, n: int) -> bytes:
    return f"POST /upload HTTP/1.1\r\nHost: api.test:{port}\r\nContent-Length: {n}\r\n\r\n".encode()


def body_size_for_exact_limit(port: int) -> int:
    n = LIMIT
    for _ in range(5):
        n = LIMIT - len(cl_head(port, n))
    assert len(cl_head(port, n)) + n == LIMIT
    return n


def tunnel(gateway, sbx):
    port = gateway.world.https_port
    sock, head = connect_tunnel(gateway, sbx, f"api.test:{port}")
    status = int(head.split(b" ")[1])
    if status != 200:
        sock.close()
        return None, status, head
    return tls_wrap(sock, gateway, "api.test"), 200, head


def post_cl(gateway, sbx, n: int) -> tuple[int, bytes]:
    tls, status, head = tunnel(gateway, sbx)
    if tls is None:
        return status, head
    port = gateway.world.https_port
    with tls:
        tls.sendall(cl_head(port, n) + b"b" * n)
        status, _, body = read_reply(tls)
    return status, body


def test_content_length_budget_exact_to_the_byte(gateway):
    world = gateway.world
    port = world.https_port
    n = body_size_for_exact_limit(port)
    # one byte too many: 429 before connecting, upstream untouched, nothing spent
    sbx = gateway.admit("gw-budget")
    mark = world.hits.mark()
    status, body = post_cl(gateway, sbx, n + 1)
    assert status == 429 and json.loads(body)["reason"] == "budget_exceeded"
    assert world.hits.since(mark) == []
    # exactly the budget: allowed and delivered whole
    status, _ = post_cl(gateway, sbx, n)
    assert status == 200
    seen = world.hits.since(mark)
    assert len(seen) == 1 and seen[0]["body_len"] == n
    # budget now exactly spent: the smallest request is refused, and so is a new CONNECT
    status, body = post_cl(gateway, sbx, 0)
    assert status == 429
    tls, status, head = tunnel(gateway, sbx)
    assert tls is None and status == 429 and b"budget_exceeded" in head
    assert len(world.hits.since(mark)) == 1


def chunked_post(gateway, sbx, sizes: list[int], pause: float = 0.0) -> tuple[int, int]:
    """Returns (status or 0 when the connection was cut, head length)."""
    port = gateway.world.https_port
    tls, status, _ = tunnel(gateway, sbx)
    assert tls is not None, status
    head = f"POST /upload HTTP/1.1\r\nHost: api.test:{port}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    try:
        tls.sendall(head)
        for size in sizes:
            tls.sendall(f"{size:x}\r\n".encode() + b"c" * size + b"\r\n")
            if pause:
                time.sleep(pause)
        tls.sendall(b"0\r\n\r\n")
        status, _, _ = read_reply(tls)
    except (ConnectionError, ssl.SSLError, OSError):
        status = 0
    finally:
        tls.close()
    return status, len(head)


def test_chunked_budget_exact_and_cut(gateway):
    world = gateway.world
    port = world.https_port
    head_len = len(f"POST /upload HTTP/1.1\r\nHost: api.test:{port}\r\nTransfer-Encoding: chunked\r\n\r\n")
    payload = LIMIT - head_len
    sizes = [500] * (payload // 500) + ([payload % 500] if payload % 500 else [])
    assert sum(sizes) == payload
    # exactly the budget, in chunks: delivered
    sbx = gateway.admit("gw-budget")
    mark = world.hits.mark()
    status, _ = chunked_post(gateway, sbx, sizes)
    assert status == 200
    assert [h["body_len"] for h in world.hits.since(mark)] == [payload]
    # one byte more, streamed: cut, the upstream never sees a complete request, and the client reads
    # the 429 deny contract (issue 23 item 6; before, a reset)
    sbx2 = gateway.admit("gw-budget")
    mark = world.hits.mark()
    status, _ = chunked_post(gateway, sbx2, [*sizes, 1], pause=0.02)
    assert status == 429
    time.sleep(0.3)
    assert world.hits.since(mark) == []
    # and the sandbox is now refused before connecting
    assert post_cl(gateway, sbx2, 1)[0] == 429


def test_large_download_streams(gateway):
    sbx = gateway.admit("gw-basic")
    n = 3_000_000
    with sbx.client() as c, c.stream("GET", sbx.url("api.test", "/big"), params={"n": n}) as r:
        total = sum(len(chunk) for chunk in r.iter_bytes())
    assert r.status_code == 200 and total == n


def test_sse_first_event_before_upstream_finishes(gateway):
    sbx = gateway.admit("gw-basic")
    key = f"k{time.monotonic_ns()}"
    got: list[tuple[float, str]] = []
    start = time.monotonic()
    with sbx.client() as c, c.stream("GET", sbx.url("sse.test", "/sse"), params={"key": key}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line:
                got.append((time.monotonic() - start, line))
                break
        # the upstream is still holding the response open (it waits for our release)
        gateway.world.release_sse(key)
        for line in lines:
            if line:
                got.append((time.monotonic() - start, line))
    assert [g[1] for g in got] == ["data: first", "data: last"]
    assert got[0][0] < 3.0  # well before the upstream's 10 s hold would have ended


def test_websocket_counted_and_cut_at_budget(gateway):
    world = gateway.world
    sbx = gateway.admit("gw-budget")
    url = f"https://api.test:{world.https_port}/ws"
    ctx = ssl.create_default_context(cafile=gateway.bundle)
    mark = world.hits.mark()

    async def run() -> tuple[int, bool]:
        sent = 0
        closed = False
        auth = {"Proxy-Authorization": aiohttp.encode_basic_auth(sbx.id, sbx.token)}
        async with aiohttp.ClientSession() as session, session.ws_connect(
            url, proxy=f"http://{gateway.proxy[0]}:{gateway.proxy[1]}", proxy_headers=auth, ssl=ctx
        ) as ws:
            for _ in range(10):
                try:
                    await ws.send_bytes(b"w" * 1000)
                    msg = await asyncio.wait_for(ws.receive(), 3)
                except (ConnectionError, TimeoutError, aiohttp.ClientError):
                    closed = True
                    break
                if msg.type != aiohttp.WSMsgType.TEXT:
                    closed = True
                    break
                sent += 1
        return sent, closed

    box: list = []
    t = threading.Thread(target=lambda: box.append(asyncio.run(run())))
    t.start()
    t.join(30)
    sent, closed = box[0]
    msgs = [h for h in world.hits.since(mark) if h["method"] == "WSMSG"]
    assert closed
    assert 1 <= sent <= 3  # 4000 bytes minus the upgrade request head leave room for 3 messages
    assert len(msgs) == sent  # the crossing message never reached the upstream


def test_budget_counts_plain_http_too(gateway):
    sbx = gateway.admit("gw-budget")
    port = gateway.world.http_port
    import base64

    auth = base64.b64encode(f"{sbx.id}:{sbx.token}".encode()).decode()
    body = b"p" * 3000
    req = (f"POST http://api.test:{port}/x HTTP/1.1\r\nHost: api.test:{port}\r\nProxy-Authorization: Basic {auth}"
           f"\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    codes = []
    for _ in range(2):
        with socket.create_connection(gateway.proxy, timeout=10) as s:
            s.sendall(req)
            codes.append(read_reply(s)[0])
    assert codes == [200, 429]
