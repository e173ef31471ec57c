"""Run inside the compose test's namespace (`ip netns exec NS python3 compose_peer.py HITS SPEC...`): an
HTTPS upstream and an HTTP metadata canary that answer with their name and append every connection
they accept to HITS ("<name> <client ip>" per line), so the test can prove who reached what.

SPEC: https:HOST:PORT:NAME:CERT:KEY or http:HOST:PORT:NAME
"""

from __future__ import annotations

import http.server
import ssl
import sys
import threading


def serve(hits: str, spec: str) -> None:
    kind, host, port, name, *tls = spec.split(":")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with open(hits, "a", encoding="utf-8") as fh:
                fh.write(f"{name} {self.client_address[0]} {self.path}\n")
            body = f"{name} says hello\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, int(port)), Handler)
    if kind == "https":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls[0], tls[1])
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main() -> None:
    hits = sys.argv[1]
    for spec in sys.argv[2:]:
        serve(hits, spec)
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin


if __name__ == "__main__":
    main()
