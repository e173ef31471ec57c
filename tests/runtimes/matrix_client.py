"""Run INSIDE a sandbox (or, for the direct control, in the world's `open` namespace) by
tests/runtimes/test_client_matrix.py: one real client, every case, one JSON line of results.

Usage: python3 matrix_client.py CLIENT MODE CONFIG.json   (Debian's python3; stdlib + the client libraries
of tests/support/sandbox_pylibs.py, put on sys.path from CONFIG["pylibs"])

MODE: `proxy` (the environment `sandbox run` gives), `transparent` (the proxy variables removed: the runtime
redirects every connection to the gateway), `direct` (no gateway: the world's CA given through each client's
own variable or flag, the positive control). In the sandbox modes the clients that read the system trust
store (DEFAULT_TRUST) run with every CA variable removed: the gateway CA must come from the system paths
(issue 21 item 3); the others keep the variable `sandbox run` sets for them (docs/runtimes.md says why).

Each case prints {"status": HTTP status or None, "body": text (head), "error": error text or None}; the
test decides what each means. Cases: allowed, denied_host, denied_path, large_body, metadata (and per client
extras such as git push, the gRPC stream, the OpenAI SDK's scrubbed key).
"""

import json
import os
import subprocess
import sys
import tempfile

CLIENT, MODE, CONFIG = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())  # noqa: SIM115
sys.path.insert(0, CONFIG["pylibs"])
CA_VARS = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
           "GIT_SSL_CAINFO", "PIP_CERT", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy", "grpc_proxy")
# grpcio is not here: its Python package installs a roots override (its bundled roots.pem), so gRPC core
# never reaches the system store; it reads only GRPC_DEFAULT_SSL_ROOTS_FILE_PATH (docs/runtimes.md)
DEFAULT_TRUST = ("curl", "wget", "git", "pip", "urllib", "aiohttp", "websockets")
LARGE = 256 * 1024  # above the ~64 KB where today's denials stop reaching the client (issue 21 item 2)
API = "https://api.matrix.test"
URLS = {"allowed": f"{API}/ok", "denied_host": "https://forbidden.test/", "denied_path": f"{API}/private/x",
        "large_body": f"{API}/private/upload", "metadata": "http://169.254.169.254/latest/meta-data/"}
TIMEOUT = 30
LARGE_TIMEOUT = 10  # today a denied large body can hang until the client's timeout (issue 21 item 2)
TMP = tempfile.mkdtemp(prefix="matrix-")

if MODE != "proxy":
    for var in PROXY_VARS:
        os.environ.pop(var, None)
if MODE == "direct":
    for var in CA_VARS:
        os.environ[var] = CONFIG["world_ca"]
    os.environ["OPENAI_API_KEY"] = CONFIG["real_key"]  # no gateway to inject the real key
elif CLIENT in DEFAULT_TRUST:
    for var in CA_VARS:
        os.environ.pop(var, None)
os.environ.setdefault("HOME", TMP)
BIG = os.path.join(TMP, "big.bin")
with open(BIG, "wb") as fh:
    fh.write(os.urandom(LARGE))


def res(status=None, body="", error=None):
    return {"status": status, "body": str(body)[:600], "error": None if error is None else str(error)[-900:]}


TIMINGS = []  # (seconds, command words): where a slow run spends its time


def run(argv, **kw):
    import time

    started = time.monotonic()
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, **kw)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(argv, 124, exc.stdout or "", f"timeout after 120 s: {exc.stderr or ''}")
    finally:
        TIMINGS.append((round(time.monotonic() - started, 2), " ".join(str(a) for a in argv[:4])[:80]))


def http_cases(fetch):
    import time

    global TIMEOUT
    out = {}
    for case, url in URLS.items():
        TIMEOUT = LARGE_TIMEOUT if case == "large_body" else 30
        started = time.monotonic()
        try:
            out[case] = fetch("POST", url, LARGE) if case == "large_body" else fetch("GET", url, 0)
        except Exception as exc:
            out[case] = res(error=f"{type(exc).__name__}: {exc}")
        out[case]["seconds"] = round(time.monotonic() - started, 2)
    return out


# ---------------------------------------------------------------------------------------------- HTTP clients
def curl(method, url, size):
    argv = ["curl", "-sS", "--max-time", str(TIMEOUT), "-o", "-", "-w", "\n@@%{http_code}", url]
    if size:
        argv += ["-X", "POST", "--data-binary", "@" + BIG, "-H", "Content-Type: application/octet-stream"]
    p = run(argv)
    body, _, code = p.stdout.rpartition("\n@@")
    status = int(code) if code.isdigit() and code != "000" else None
    return res(status, body, None if p.returncode == 0 else f"rc={p.returncode} {p.stderr}")


def wget(method, url, size):
    argv = ["wget", "-S", "-O", "-", f"--timeout={TIMEOUT}", "--tries=1", "--content-on-error", url]
    if size:
        argv.append("--post-file=" + BIG)
    if MODE == "direct":
        argv.append("--ca-certificate=" + CONFIG["world_ca"])  # wget reads no CA variable
    p = run(argv)
    codes = [line.split()[1] for line in p.stderr.splitlines() if line.strip().startswith("HTTP/")]
    status = int(codes[-1]) if codes else None
    return res(status, p.stdout, None if p.returncode == 0 else f"rc={p.returncode} {p.stderr}")


def urllib_fetch(method, url, size):
    import urllib.error
    import urllib.request

    data = open(BIG, "rb").read() if size else None  # noqa: SIM115
    try:
        request = urllib.request.Request(url, data=data, method=method)  # noqa: S310 - https/http URLs of the test
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:  # noqa: S310
            return res(r.status, r.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        return res(exc.code, exc.read().decode("utf-8", "replace"), f"HTTPError: {exc}")


def requests_fetch(method, url, size):
    import requests

    r = requests.request(method, url, data=open(BIG, "rb").read() if size else None, timeout=TIMEOUT)  # noqa: SIM115
    return res(r.status_code, r.text)


def httpx_fetch(method, url, size):
    import httpx

    r = httpx.request(method, url, content=open(BIG, "rb").read() if size else None, timeout=TIMEOUT)  # noqa: SIM115
    return res(r.status_code, r.text)


def aiohttp_fetch(method, url, size):
    import asyncio

    import aiohttp

    async def go():
        # trust_env: how aiohttp is told to use the proxy variables (without it, proxy mode is transparent)
        async with aiohttp.ClientSession(trust_env=True, timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s, \
                s.request(method, url, data=open(BIG, "rb").read() if size else None) as r:
            return res(r.status, await r.text())

    return asyncio.run(go())


NODE = r"""
const [url, method, file] = process.argv.slice(1);
const body = file ? require('fs').readFileSync(file) : undefined;
fetch(url, {method, body, signal: AbortSignal.timeout(Number(process.env.MATRIX_TIMEOUT) * 1000)}).then(async r => {
  console.log(JSON.stringify({status: r.status, body: (await r.text()).slice(0, 600), error: null}));
}, e => console.log(JSON.stringify({status: null, body: '', error: String(e) + ' ' + String(e.cause || '')})));
"""


def node_fetch(method, url, size):
    env = dict(os.environ, MATRIX_TIMEOUT=str(TIMEOUT))
    p = run(["node", "-e", NODE, url, method, *([BIG] if size else [])], env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else res(error=f"rc={p.returncode} {p.stderr}")


# ---------------------------------------------------------------------------------------------- tools
def pip_cases():
    def pip(index):
        argv = ["/usr/bin/python3", "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                "--disable-pip-version-check", "--retries", "0", "--timeout", "20",
                "-d", tempfile.mkdtemp(dir=TMP), "--index-url", index, "egpkg"]
        if index.startswith("http://"):
            argv += ["--trusted-host", index.split("/")[2]]
        p = run(argv, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        ok = p.returncode == 0 and "Saved" in p.stdout
        return res(200 if ok else None, p.stdout[-600:], None if ok else f"rc={p.returncode} {p.stdout} {p.stderr}")

    return {"allowed": pip("https://pypi.matrix.test/simple/"), "denied_host": pip("https://forbidden.test/simple/"),
            "denied_path": pip("https://pypi.matrix.test/private/simple/"),
            "metadata": pip("http://169.254.169.254/simple/")}


def npm_cases():
    def npm(registry):
        prefix = tempfile.mkdtemp(dir=TMP)
        p = run(["npm", "install", "egpkg", "--registry", registry, "--prefix", prefix, "--no-audit", "--no-fund",
                 "--cache", os.path.join(prefix, ".cache"), "--fetch-retries", "0", "--fetch-timeout", "20000",
                 "--loglevel", "error", "--no-update-notifier"])
        ok = p.returncode == 0 and os.path.exists(os.path.join(prefix, "node_modules", "egpkg", "package.json"))
        return res(200 if ok else None, p.stdout[-600:], None if ok else f"rc={p.returncode} {p.stdout} {p.stderr}")

    return {"allowed": npm("https://npm.matrix.test/"), "denied_host": npm("https://forbidden.test/"),
            "denied_path": npm("https://npm.matrix.test/private/"), "metadata": npm("http://169.254.169.254/")}


def git_cases():
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@x",
               GIT_COMMITTER_NAME="a", GIT_COMMITTER_EMAIL="a@x", GIT_CONFIG_NOSYSTEM="1")

    def clone(url):
        dest = tempfile.mkdtemp(dir=TMP)
        p = run(["git", "clone", "--quiet", url, dest + "/w"], env=env)
        return dest + "/w", res(200 if p.returncode == 0 else None, "", None if p.returncode == 0 else
                                f"rc={p.returncode} {p.stderr}")

    work, out = clone("https://git.matrix.test/repo.git")
    out = {"allowed": out}
    if out["allowed"]["status"] == 200:
        with open(os.path.join(work, f"pushed-{MODE}.txt"), "w") as fh:
            fh.write("from the matrix\n")
        run(["git", "-C", work, "add", "."], env=env)
        run(["git", "-C", work, "commit", "-qm", f"push from {MODE}"], env=env)
        p = run(["git", "-C", work, "push", "-q", "origin", f"HEAD:refs/heads/matrix-{MODE}"], env=env)
        out["push"] = res(200 if p.returncode == 0 else None, "", None if p.returncode == 0 else
                          f"rc={p.returncode} {p.stderr}")
    out["denied_host"] = clone("https://forbidden.test/repo.git")[1]
    out["denied_path"] = clone("https://git.matrix.test/private.git")[1]
    out["metadata"] = clone("http://169.254.169.254/repo.git")[1]
    return out


def openai_cases():
    import openai

    def chat(base, content="hi"):
        try:
            timeout = LARGE_TIMEOUT if len(content) > 1000 else TIMEOUT
            client = openai.OpenAI(base_url=base, timeout=timeout, max_retries=0)  # key: OPENAI_API_KEY
            stream = client.chat.completions.create(model="m", stream=True,
                                                    messages=[{"role": "user", "content": content}])
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            return res(200, text)
        except openai.APIStatusError as exc:
            return res(exc.status_code, exc.response.text, f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            return res(error=f"{type(exc).__name__}: {exc} {exc.__cause__!r}")

    out = {"allowed": chat("https://llm.matrix.test/v1"), "denied_host": chat("https://forbidden.test/v1"),
           "denied_path": chat("https://llm.matrix.test/private/v1"),
           "large_body": chat("https://llm.matrix.test/private/v1", "x" * LARGE),
           "metadata": chat("http://169.254.169.254/v1")}
    out["allowed"]["env_key"] = os.environ.get("OPENAI_API_KEY", "")
    return out


def websockets_cases():
    from websockets.sync.client import connect

    def echo(url):
        try:
            with connect(url, open_timeout=TIMEOUT, close_timeout=5) as ws:
                ws.send("ping-matrix")
                return res(101, ws.recv(timeout=TIMEOUT))
        except Exception as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            body = getattr(getattr(exc, "response", None), "body", b"") or b""
            return res(status, body.decode("utf-8", "replace"), f"{type(exc).__name__}: {exc}")

    return {"allowed": echo("wss://ws.matrix.test/echo"), "denied_host": echo("wss://forbidden.test/echo"),
            "denied_path": echo("wss://ws.matrix.test/private/echo"), "metadata": echo("ws://169.254.169.254/")}


def grpcio_cases():
    import grpc

    def call(target, method, payload, stream=False, timeout=TIMEOUT):
        with grpc.secure_channel(target, grpc.ssl_channel_credentials(),
                                 options=[("grpc.enable_retries", 0)]) as ch:
            try:
                if stream:
                    got = [m for m in ch.unary_stream(method)(payload, timeout=60)]
                    ordered = all(m == b"%06d" % i for i, m in enumerate(got))
                    return res(200, f"{len(got)} messages{' in order' if ordered else ' OUT OF ORDER'}")
                return res(200, ch.unary_unary(method)(payload, timeout=timeout).decode("utf-8", "replace"))
            except grpc.RpcError as exc:
                return res(None, "", f"{exc.code()}: {exc.details()}")

    target = "grpc.matrix.test:443"
    return {"allowed": call(target, "/matrix.Echo/Unary", b"hi"),
            "stream": call(target, "/matrix.Echo/Stream", b"1000", stream=True),
            "denied_host": call("forbidden.test:443", "/matrix.Echo/Unary", b"hi"),
            "denied_path": call(target, "/matrix.Echo/Secret", b"hi"),
            "large_body": call(target, "/matrix.Echo/Secret", b"x" * LARGE, timeout=LARGE_TIMEOUT),
            "metadata": call("169.254.169.254:443", "/matrix.Echo/Unary", b"hi")}


TRUST_PROBE = r"""
import os, sys
which, url = sys.argv[1], sys.argv[2]
try:
    if which == "requests":
        import requests
        print("ok", requests.get(url, timeout=30).status_code)
    elif which == "httpx":
        import httpx
        print("ok", httpx.get(url, timeout=30).status_code)
    else:
        import grpc
        with grpc.secure_channel(url, grpc.ssl_channel_credentials()) as ch:
            print("ok", ch.unary_unary("/matrix.Echo/Unary")(b"hi", timeout=30))
except Exception as exc:
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    print("failed", type(exc).__name__, detail[-400:])
"""


def trust_cases():
    """Which Python clients need their own CA variable (issue 21 item 3): each with every CA variable removed
    ("none") and with only its own variable as `sandbox run` sets it. Debian's requests (python3-certifi:
    the system store) against requests, httpx and grpcio from PyPI (certifi's and grpcio's own roots)."""
    bare = {k: v for k, v in os.environ.items() if k not in CA_VARS and k != "PYTHONPATH"}
    own = {"requests": "REQUESTS_CA_BUNDLE", "httpx": "SSL_CERT_FILE", "grpcio": "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"}
    out = {}

    def probe(name, which, url, env):
        p = run(["/usr/bin/python3", "-c", TRUST_PROBE, which, url], env=env)
        out[name] = res(200 if p.stdout.startswith("ok") else None, p.stdout, None if p.stdout.startswith("ok")
                        else p.stdout + p.stderr[-300:])

    probe("debian_requests_none", "requests", f"{API}/ok", bare)
    for which, url in (("requests", f"{API}/ok"), ("httpx", f"{API}/ok"), ("grpcio", "grpc.matrix.test:443")):
        pypi = dict(bare, PYTHONPATH=CONFIG["pylibs"])
        probe(f"pypi_{which}_none", which, url, pypi)
        probe(f"pypi_{which}_own_var", which, url, dict(pypi, **{own[which]: os.environ[own[which]]}))
    return out


def bundle_cases():
    """curl with no CA variable (the system paths) and with only the gateway CA (the last certificate of the
    bundle), against an intercepted host and a `tls: passthrough` one."""
    bare = {k: v for k, v in os.environ.items() if k not in CA_VARS}
    with open("/etc/egressgate/ca.pem", "rb") as fh:
        last = fh.read().rsplit(b"-----BEGIN CERTIFICATE-----", 1)[1]
    gateway_only = os.path.join(TMP, "gateway-ca-only.pem")
    with open(gateway_only, "wb") as fh:
        fh.write(b"-----BEGIN CERTIFICATE-----" + last)
    out = {}
    for name, url in (("intercepted", f"{API}/ok"), ("passthrough", "https://pass.matrix.test/ok")):
        # curl reads its compiled-in CApath (/etc/ssl/certs) next to --cacert: an empty one keeps it to the file
        only = ["--cacert", gateway_only, "--capath", tempfile.mkdtemp(dir=TMP)]
        for store, extra in (("system_store", []), ("gateway_ca_only", only)):
            p = run(["curl", "-sS", "--max-time", str(TIMEOUT), *extra, "-o", "-", "-w", "\n@@%{http_code}", url],
                    env=bare)
            body, _, code = p.stdout.rpartition("\n@@")
            out[f"{name}_{store}"] = res(int(code) if code.isdigit() and code != "000" else None, body,
                                         None if p.returncode == 0 else f"rc={p.returncode} {p.stderr}")
    return out


CLIENTS = {
    "curl": lambda: http_cases(curl), "wget": lambda: http_cases(wget), "urllib": lambda: http_cases(urllib_fetch),
    "requests": lambda: http_cases(requests_fetch), "httpx": lambda: http_cases(httpx_fetch),
    "aiohttp": lambda: http_cases(aiohttp_fetch), "node": lambda: http_cases(node_fetch),
    "pip": pip_cases, "npm": npm_cases, "git": git_cases, "openai": openai_cases, "websockets": websockets_cases,
    "grpcio": grpcio_cases, "trust": trust_cases, "bundle": bundle_cases,
}

if __name__ == "__main__":
    results = CLIENTS[CLIENT]()
    print("MATRIX " + json.dumps(results), flush=True)
    print("TIMINGS " + json.dumps(sorted(TIMINGS, reverse=True)[:8]), flush=True)
