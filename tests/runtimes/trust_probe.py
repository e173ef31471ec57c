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
import shutil
import socket
import ssl
import subprocess
import sys

CA_VARS = (
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "PIP_CERT",
    "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",
)
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
FILES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/ssl/cert.pem",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/pki/tls/cacert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/egressgate/ca.pem",
)


LISTENERS = []  # (socket, TLS context): one child process serves them all (start_server)


def serve(certdir: str, name: str) -> int:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(os.path.join(certdir, name + ".pem"), os.path.join(certdir, name + ".key"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    LISTENERS.append((sock, ctx))
    return sock.getsockname()[1]


def answer(sock: socket.socket, ctx: ssl.SSLContext) -> None:
    conn, _ = sock.accept()
    try:
        conn.settimeout(10)
        with ctx.wrap_socket(conn, server_side=True) as tls:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = tls.recv(4096)
                if not chunk:
                    break
                head += chunk
            tls.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
            )
    except (OSError, ssl.SSLError):
        conn.close()


def start_server() -> int:
    """A forked child serving every listener; not a thread: under this gVisor (runsc 20221219) no thread can
    be created (glibc's clone3 gets EPERM instead of the profile's ENOSYS, so it does not fall back)."""
    pid = os.fork()
    if pid == 0:
        try:
            serve_forever()
        finally:
            os._exit(0)
    return pid


def serve_forever() -> None:
    import select

    by_fd = {sock.fileno(): (sock, ctx) for sock, ctx in LISTENERS}
    while True:
        ready, _, _ = select.select(list(by_fd), [], [])
        for fd in ready:
            answer(*by_fd[fd])


def verify(ctx: ssl.SSLContext, port: int) -> str:
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
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
# node's https module (its native HTTP parser: fetch's wasm one needs more address space than the tests'
# RLIMIT_AS safety net allows; fetch itself runs in the client matrix)
NODE_GET = (
    "require('https').get(process.argv[1], r => {let b = ''; r.on('data', c => b += c);"
    " r.on('end', () => console.log(b))}).on('error', e => {console.log(String(e)); process.exit(1)})"
)
CLIENTS = {
    "curl": ["curl", "-sS", "--max-time", "20"],
    "wget": ["wget", "-nv", "-O-", "--timeout=20", "--tries=1"],
    "node --use-openssl-ca": ["node", "--use-openssl-ca", "-e", NODE_GET],
    "node": ["node", "-e", NODE_GET],
}


def run_client(argv: list, url: str) -> str:
    try:
        res = subprocess.run([*argv, url], capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:
        return "not runnable: " + str(exc)
    if res.returncode == 0 and res.stdout.strip().endswith("hello"):
        return "ok"
    return f"rc={res.returncode} " + (res.stderr + res.stdout).strip()[-300:]


def run_java(argv: list, good: int, bad: int) -> tuple:
    """One JVM for both servers (Fetch): (good's result, bad's result), each "ok" or what failed."""
    urls = [f"https://127.0.0.1:{port}/" for port in (good, bad)]
    try:
        res = subprocess.run([*argv, *urls], capture_output=True, text=True, timeout=120, check=False)
    except OSError as exc:
        return ("not runnable: " + str(exc),) * 2
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if line.startswith("https://") and " " in line)
    failed = f"rc={res.returncode} " + (res.stderr + res.stdout).strip()[-300:]
    return tuple(lines.get(url, failed)[:300] for url in urls)


# one JVM per trust store fetches every URL it is given, each with a client of its own (a JVM start costs
# ~0.7 CPU-s; the good and the bad server in one run instead of one run each): one line per URL, "URL ok" or
# "URL <the exception>"
JAVA_FETCH = """
public class Fetch {
  public static void main(String[] a) {
    for (String url : a) {
      String out;
      try {
        var r = java.net.http.HttpClient.newHttpClient().send(
            java.net.http.HttpRequest.newBuilder(java.net.URI.create(url)).build(),
            java.net.http.HttpResponse.BodyHandlers.ofString());
        out = r.body().endsWith("hello") ? "ok" : "no data";
      } catch (Exception e) {
        out = String.valueOf(e);
      }
      System.out.println(url + " " + out.replace('\\n', ' '));
    }
  }
}
"""
# under RLIMIT_AS (sizes); C1 only and the serial collector: a run this short gains nothing from C2 or
# parallel GC threads, which only burn CPU (the TLS code and its trust decisions are the same)
JVM = [
    "-Xmx64m",
    "-XX:CompressedClassSpaceSize=64m",
    "-XX:ReservedCodeCacheSize=32m",
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
]
# docs/runtimes.md's recipe, word for word apart from the JVM flags (sizing, JIT tier, GC): the gateway CA (the
# bundle's last certificate) added to a copy of the JDK's own store
JAVA_RECIPE = """set -e
awk '/BEGIN CERT/{c=""} {c=c $0 "\\n"} END{printf "%s", c}' /etc/egressgate/ca.pem > "$1/gateway-ca.pem"
JAVA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")
cp -L "$JAVA_HOME/lib/security/cacerts" "$1/cacerts"
chmod u+w "$1/cacerts"
keytool -J-Xmx32m -J-XX:CompressedClassSpaceSize=32m -J-XX:TieredStopAtLevel=1 -J-XX:+UseSerialGC -importcert \\
  -noprompt -alias egressgate -file "$1/gateway-ca.pem" -keystore "$1/cacerts" -storepass changeit >/dev/null
"""


def java_clients(tmp: str) -> dict:
    """argv per Java client (the JDK's default store; the recipe's store), or {} without a JDK."""
    if not shutil.which("java") or not shutil.which("keytool"):
        return {}
    with open(os.path.join(tmp, "Fetch.java"), "w") as fh:
        fh.write(JAVA_FETCH)
    recipe = subprocess.run(["sh", "-c", JAVA_RECIPE, "recipe", tmp], capture_output=True, text=True, timeout=120)
    if recipe.returncode != 0:
        return {"java (recipe)": ["sh", "-c", "echo recipe failed: " + repr(recipe.stderr[-300:]) + "; exit 1"]}
    # compiled once (javac, where the JDK has it): the source launcher compiled Fetch.java again in each of
    # the four runs (~1 CPU-second each); the class is the same program either way
    fetch = [os.path.join(tmp, "Fetch.java")]
    if shutil.which("javac"):
        javac = subprocess.run(
            ["javac", *["-J" + flag for flag in JVM], "-d", tmp, fetch[0]], capture_output=True, text=True, timeout=120
        )
        if javac.returncode != 0:
            failed = ["sh", "-c", "echo javac failed: " + repr(javac.stderr[-300:]) + "; exit 1"]
            return {"java (default store)": failed, "java (recipe)": failed}
        fetch = ["-cp", tmp, "Fetch"]
    return {
        "java (default store)": ["java", *JVM, *fetch],
        "java (recipe)": [
            "java",
            *JVM,
            "-Djavax.net.ssl.trustStore=" + os.path.join(tmp, "cacerts"),
            "-Djavax.net.ssl.trustStorePassword=changeit",
            *fetch,
        ],
    }


def run_git(port: int) -> str:
    """git's TLS (libcurl) against the server; the server is no git server, so success is an error AFTER
    the handshake (HTTP level), failure a certificate error."""
    res = subprocess.run(
        ["git", "ls-remote", f"https://127.0.0.1:{port}/repo.git"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=dict(os.environ, GIT_TERMINAL_PROMPT="0", HOME="/tmp"),
    )
    err = res.stderr.strip()
    if "unable to access" in err or "certificate" in err.lower():  # transport or TLS failure
        return f"rc={res.returncode} {err[-300:]}"
    return "ok" if "not valid" in err or "not found" in err or res.returncode == 0 else f"rc={res.returncode} {err}"


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
    for var in (*CA_VARS, *PROXY_VARS):  # the servers are on the sandbox's own loopback
        os.environ.pop(var, None)
    result = {"env_left": [v for v in CA_VARS if v in os.environ], "files": {}, "good": {}, "bad": {}}
    for path in FILES:
        try:
            with open(path, "rb") as fh:
                result["files"][path] = hashlib.sha256(fh.read()).hexdigest() == expected
        except OSError as exc:
            result["files"][path] = str(exc)
    good, bad = serve(certdir, "good"), serve(certdir, "bad")
    server = start_server()
    for name, ctx in contexts().items():
        if isinstance(ctx, str):
            result["good"][name] = result["bad"][name] = ctx
            continue
        result["good"][name] = verify(ctx, good)
        result["bad"][name] = verify(ctx, bad)
    if clients:
        import tempfile

        for name, argv in CLIENTS.items():
            for which, port in (("good", good), ("bad", bad)):
                result[which][name] = run_client(argv, f"https://127.0.0.1:{port}/")
        for name, argv in java_clients(tempfile.mkdtemp()).items():
            result["good"][name], result["bad"][name] = run_java(argv, good, bad)
        result["good"]["git"], result["bad"]["git"] = run_git(good), run_git(bad)
    os.kill(server, 9)
    os.waitpid(server, 0)
    print(json.dumps(result))
    if len(args) > 2:  # container runs: the workload's stdout is not the test's
        with open(args[2], "w") as fh:
            fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
