"""Run INSIDE a sandbox by the trust tests (stdlib only, Python >= 3.9): which trust paths hold the expected
bundle, and whether TLS clients configured only by the system's default paths verify a server whose
certificate chains to the sandbox bundle's CA.

The servers are on the sandbox's own loopback (no network needed): `good` presents a leaf of a CA in the
bundle, `bad` a leaf of a CA that is not (the positive control: a client that verified nothing would accept
it too). Every CA environment variable is removed first, so only the default paths can make `good` verify.
With --clients, the host's curl, wget, git and node (as found on PATH) are run against both servers too.

Usage: python3 trust_probe.py [--clients] DIR SHA256 [OUT]  (DIR holds good.pem/good.key/bad.pem/bad.key;
prints one JSON line, also written to OUT when given)
"""

import hashlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading

CA_VARS = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
           "GIT_SSL_CAINFO", "PIP_CERT", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")
FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/ssl/cert.pem", "/etc/ssl/ca-bundle.pem",
         "/etc/pki/tls/certs/ca-bundle.crt", "/etc/pki/tls/cacert.pem",
         "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", "/etc/egressgate/ca.pem")


def serve(certdir: str, name: str) -> int:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(os.path.join(certdir, name + ".pem"), os.path.join(certdir, name + ".key"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def loop() -> None:
        while True:
            conn, _ = sock.accept()
            try:
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.settimeout(10)
                    head = b""
                    while b"\r\n\r\n" not in head:
                        chunk = tls.recv(4096)
                        if not chunk:
                            break
                        head += chunk
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n"
                                b"Connection: close\r\n\r\nhello")
            except (OSError, ssl.SSLError):
                conn.close()

    for _ in range(4):  # clients run one after another; a slow handshake must not stall the next
        threading.Thread(target=loop, daemon=True).start()
    return sock.getsockname()[1]


def verify(ctx: ssl.SSLContext, port: int) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            data = b""
            while True:
                chunk = tls.recv(4096)
                if not chunk:
                    break
                data += chunk
            return "ok" if data.endswith(b"hello") else "no data"
    except (OSError, ssl.SSLError) as exc:
        return type(exc).__name__ + ": " + str(exc)[:160]


# the host's command-line clients, each with nothing but its defaults (no CA flag, no CA variable)
NODE_FETCH = ("fetch(process.argv[1]).then(r => r.text())"
              ".then(t => console.log(t), e => {console.log(String(e.cause || e)); process.exit(1)})")
CLIENTS = {
    "curl": ["curl", "-sS", "--max-time", "20"],
    "wget": ["wget", "-qO-", "--timeout=20", "--tries=1"],
    "node --use-openssl-ca": ["node", "--use-openssl-ca", "-e", NODE_FETCH],
    "node": ["node", "-e", NODE_FETCH],
}


def run_client(argv: list, url: str) -> str:
    try:
        res = subprocess.run([*argv, url], capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:
        return "not runnable: " + str(exc)
    if res.returncode == 0 and res.stdout.strip().endswith("hello"):
        return "ok"
    return f"rc={res.returncode} " + (res.stderr + res.stdout).strip()[-300:]


def run_git(port: int) -> str:
    """git's TLS (libcurl) against the server; the server is no git server, so success is an error AFTER
    the handshake (HTTP level), failure a certificate error."""
    res = subprocess.run(["git", "ls-remote", f"https://127.0.0.1:{port}/repo.git"], capture_output=True,
                         text=True, timeout=60, check=False, env=dict(os.environ, GIT_TERMINAL_PROMPT="0",
                                                                      HOME="/tmp"))
    err = res.stderr.strip()
    if "certificate" in err.lower() or "ssl" in err.lower():
        return "certificate error: " + err[-300:]
    return "ok" if "repo.git" in err or res.returncode == 0 else f"rc={res.returncode} {err[-300:]}"


def contexts() -> dict:
    out = {"default": ssl.create_default_context()}
    capath = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    capath.load_verify_locations(capath="/etc/ssl/certs")
    out["capath:/etc/ssl/certs"] = capath
    for path in FILES:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            ctx.load_verify_locations(cafile=path)
        except OSError as exc:
            out["cafile:" + path] = str(exc)
            continue
        out["cafile:" + path] = ctx
    return out


def main() -> None:
    clients = "--clients" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--clients"]
    certdir, expected = args[0], args[1]
    for var in CA_VARS:
        os.environ.pop(var, None)
    result = {"env_left": [v for v in CA_VARS if v in os.environ], "files": {}, "good": {}, "bad": {}}
    for path in FILES:
        try:
            with open(path, "rb") as fh:
                result["files"][path] = hashlib.sha256(fh.read()).hexdigest() == expected
        except OSError as exc:
            result["files"][path] = str(exc)
    good, bad = serve(certdir, "good"), serve(certdir, "bad")
    for name, ctx in contexts().items():
        if isinstance(ctx, str):
            result["good"][name] = result["bad"][name] = ctx
            continue
        result["good"][name] = verify(ctx, good)
        result["bad"][name] = verify(ctx, bad)
    if clients:
        for name, argv in CLIENTS.items():
            for which, port in (("good", good), ("bad", bad)):
                result[which][name] = run_client(argv, f"https://127.0.0.1:{port}/")
        result["good"]["git"], result["bad"]["git"] = run_git(good), run_git(bad)
    print(json.dumps(result))
    if len(args) > 2:  # container runs: the workload's stdout is not the test's
        with open(args[2], "w") as fh:
            fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
