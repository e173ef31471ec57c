"""Run inside a test namespace (`ip netns exec NS python3 fc_peer.py ...`): tiny servers that say who
they are, and clients that report what answered. Used by test_firecracker.py."""

from __future__ import annotations

import socket
import sys
import threading


def serve_tcp(host: str, port: int, name: bytes) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(16)

    def loop() -> None:
        while True:
            conn, _ = srv.accept()
            conn.sendall(name)
            conn.close()

    threading.Thread(target=loop, daemon=True).start()


def serve_udp(host: str, port: int, name: bytes) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind((host, port))

    def loop() -> None:
        while True:
            _, peer = srv.recvfrom(2048)
            srv.sendto(name, peer)

    threading.Thread(target=loop, daemon=True).start()


def main() -> None:
    if sys.argv[1] == "serve":  # serve tcp|udp HOST PORT NAME ...
        args = sys.argv[2:]
        for i in range(0, len(args), 4):
            kind, host, port, name = args[i:i + 4]
            (serve_tcp if kind == "tcp" else serve_udp)(host, int(port), name.encode())
        print("ready", flush=True)
        sys.stdin.read()  # until the test closes our stdin
        return
    kind, host, port = sys.argv[2], sys.argv[3], int(sys.argv[4])  # ask tcp|udp HOST PORT
    try:
        if kind == "tcp":
            with socket.create_connection((host, port), timeout=2) as s:
                print(s.recv(64).decode() or "EMPTY")
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.settimeout(2)
                s.sendto(b"q", (host, port))
                print(s.recv(64).decode())
    except OSError as exc:
        print(f"ERR {type(exc).__name__}")


if __name__ == "__main__":
    main()
