"""A sandbox must never reach the gateway's own state store, whatever its policy allows.

The gateway already refuses to relay to its own listeners (`self_connection`, context.Runtime.is_self):
a policy that opens loopback (`allow_private: [127.0.0.1/32]`, common on a dev host) would otherwise hand
the sandbox the admin API. The Redis behind `state:` is the same kind of target and worse: raw RESP
through a `tcp` rule lets the sandbox reset its own spent budget (`HSET <prefix>ctr:<id> out 0`),
un-revoke itself, or FLUSHALL every sandbox's state. Redis's own cross-protocol guard only stops
HTTP-looking input, not a raw TCP tunnel.
"""

from __future__ import annotations

import asyncio
import base64
import socket
import threading

from tests.support.http1 import read_head
from tests.support.launcher import launch_loopback, stop_process, write_policies
from tests.support.redis import RedisServer


def _connect(proxy: tuple[str, int], sbx: dict, target: str) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(proxy, timeout=10)
    cred = base64.b64encode(f"{sbx['id']}:{sbx['token']}".encode()).decode()
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {cred}\r\n\r\n".encode())
    head = read_head(sock)
    if not head.startswith(b"HTTP/1.1 200"):  # a refusal: its JSON body follows, then the proxy closes
        while chunk := sock.recv(4096):
            head += chunk
    return sock, head


def _echo_server() -> tuple[int, threading.Event]:
    """A loopback TCP echo server (the positive control's target)."""
    ready, stop = threading.Event(), threading.Event()
    port_box: list[int] = []

    async def serve() -> None:
        async def echo(reader, writer):
            writer.write(await reader.read(100))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port_box.append(server.sockets[0].getsockname()[1])
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.close()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    ready.wait(5)
    return port_box[0], stop


def test_a_tcp_rule_to_loopback_does_not_reach_the_gateways_redis(tmp_path):
    echo_port, stop_echo = _echo_server()
    with RedisServer(tmp_path / "redis") as server:
        policies = write_policies(tmp_path / "policies", {"p": {
            "sandbox": {"name": "p"},
            "network": {"allow_private": ["127.0.0.1/32"], "tcp": {"allow": [
                {"id": "loop", "host": "127.0.0.1", "ports": [server.port, echo_port]}]}}}})
        config = {"listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
                  "policy": str(policies), "var_dir": str(tmp_path / "var"),
                  "broker": {"local_key_dir": str(tmp_path / "var" / "keys")},
                  "state": {"backend": "redis", "url": server.url, "key_prefix": server.prefix()}}
        gw = launch_loopback(tmp_path, config)
        try:
            import httpx

            sbx = httpx.post(f"http://{gw['admin']}/v1/sandboxes", json={"policy": "p"}, trust_env=False,
                             headers={"Authorization": f"Bearer {gw['token']}"}, timeout=10).json()
            # positive control: the rule does open raw TCP to loopback
            sock, head = _connect(gw["proxy"], sbx, f"127.0.0.1:{echo_port}")
            with sock:
                assert head.startswith(b"HTTP/1.1 200"), head
                sock.sendall(b"hello")
                assert sock.recv(100) == b"hello"
            sock, head = _connect(gw["proxy"], sbx, f"127.0.0.1:{server.port}")
            with sock:
                reached = b""
                if head.startswith(b"HTTP/1.1 200"):
                    sock.sendall(b"PING\r\n")
                    reached = sock.recv(100)
                assert not reached.startswith(b"+PONG"), "the sandbox talks RESP to the gateway's own Redis"
                # refused self_connection: accepted to answer inside (deny.connect_in_tunnel), the bytes get the deny
                assert b"X-Egressgate-Decision: deny" in head and b"self_connection" in head, head
                assert head.startswith(b"HTTP/1.1 403") or reached.startswith(b"HTTP/1.1 403"), (head, reached)
        finally:
            stop_process(gw["proc"])
            stop_echo.set()
