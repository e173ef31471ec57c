"""Local package and publishing servers for the operation-class tests (loopback only).

One stdlib HTTP server on 127.0.0.1 speaks every protocol the tests drive real clients against:
- a PEP 503 index (`/simple/`, `/simple/tinywheel/`) and the wheel it lists (`/files/...whl`), built here;
- an npm registry: the packument `/tinynpm` and its tarball `/tinynpm/-/tinynpm-1.0.0.tgz`; `PUT /NAME`
  (npm publish) stores the document;
- PyPI's upload endpoint (`POST /legacy/`, twine);
- git smart HTTP under `/git/` through the real `git http-backend` (CGI), receive-pack enabled.
Every request is recorded (`hits`) so a test can show that nothing reached the upstream before an approval.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import ssl
import subprocess
import tarfile
import threading
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

GIT_BACKEND = "/usr/lib/git-core/git-http-backend"
WHEEL_NAME = "tinywheel-1.0-py3-none-any.whl"
NPM_TARBALL = "tinynpm-1.0.0.tgz"


def build_wheel() -> bytes:
    """A minimal valid pure-Python wheel: `import tinywheel; tinywheel.VALUE == 42`."""
    files = {
        "tinywheel/__init__.py": b"VALUE = 42\n",
        "tinywheel-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinywheel\nVersion: 1.0\nSummary: t\n",
        "tinywheel-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: egressgate-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinywheel-1.0.dist-info/RECORD,,")
    files["tinywheel-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return out.getvalue()


def build_npm_tarball(name: str = "tinynpm", version: str = "1.0.0") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tf:
        for member, data in (
            ("package/package.json", json.dumps({"name": name, "version": version, "main": "index.js"}).encode()),
            ("package/index.js", b"module.exports = 42;\n"),
        ):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


@dataclass
class PkgServer:
    root: Path
    host: str = "pkgs.test"
    port: int = 0
    hits: list[tuple[str, str]] = field(default_factory=list)  # (method, path with query)
    published: dict[str, dict] = field(default_factory=dict)  # npm documents PUT by npm publish
    uploads: list[bytes] = field(default_factory=list)  # twine upload bodies
    wheel: bytes = b""
    tarball: bytes = b""
    _server: ThreadingHTTPServer | None = None

    scheme: str = "http"

    @property
    def base(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def mark(self) -> int:
        return len(self.hits)

    def since(self, mark: int) -> list[tuple[str, str]]:
        return self.hits[mark:]

    def bare_repo(self, name: str) -> Path:
        """A bare repository served at /git/NAME (push over HTTP enabled)."""
        path = self.root / "git" / name
        subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(path)], check=True)
        subprocess.run(["git", "-C", str(path), "config", "http.receivepack", "true"], check=True)
        return path

    def start(self, tls: ssl.SSLContext | None = None) -> PkgServer:
        """Serve on a free loopback port; HTTPS with `tls` (a server context), so a client's requests reach
        it only through the gateway's intercepted tunnel."""
        self.wheel = build_wheel()
        self.tarball = build_npm_tarball()
        (self.root / "git").mkdir(parents=True, exist_ok=True)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        if tls is not None:
            self.scheme = "https"
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def packument(self) -> dict:
        sha1 = hashlib.sha1(self.tarball).hexdigest()
        integrity = "sha512-" + base64.b64encode(hashlib.sha512(self.tarball).digest()).decode()
        version = {
            "name": "tinynpm",
            "version": "1.0.0",
            "main": "index.js",
            "dist": {"tarball": f"{self.base}/tinynpm/-/{NPM_TARBALL}", "shasum": sha1, "integrity": integrity},
        }
        return {"name": "tinynpm", "dist-tags": {"latest": "1.0.0"}, "versions": {"1.0.0": version}}


def _handler(srv: PkgServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            return

        def _send(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return data
                    data += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _route(self) -> None:
            srv.hits.append((self.command, self.path))
            path, _, query = self.path.partition("?")
            if path.startswith("/git/"):
                self._git(path, query)
                return
            body = self._body() if self.command in ("POST", "PUT", "PATCH") else b""
            if self.command in ("GET", "HEAD"):
                if path == "/simple/":
                    self._send(
                        200, b'<html><body><a href="/simple/tinywheel/">tinywheel</a></body></html>', "text/html"
                    )
                elif path == "/simple/tinywheel/":
                    digest = hashlib.sha256(srv.wheel).hexdigest()
                    self._send(
                        200,
                        f'<html><body><a href="/files/{WHEEL_NAME}#sha256={digest}">{WHEEL_NAME}</a>'
                        "</body></html>".encode(),
                        "text/html",
                    )
                elif path == f"/files/{WHEEL_NAME}":
                    self._send(200, srv.wheel, "application/octet-stream")
                elif path == "/tinynpm":
                    self._send(200, json.dumps(srv.packument()).encode(), "application/json")
                elif path == f"/tinynpm/-/{NPM_TARBALL}":
                    self._send(200, srv.tarball, "application/octet-stream")
                else:
                    self._send(404, b"not found")
            elif self.command == "PUT" and path.count("/") == 1:  # npm publish
                srv.published[path[1:]] = json.loads(body or b"{}")
                self._send(200, b'{"ok":true}', "application/json")
            elif self.command == "POST" and path in ("/legacy/", "/"):  # twine upload
                srv.uploads.append(body)
                self._send(200, b"OK")
            else:
                self._send(405, b"method not allowed")

        def _git(self, path: str, query: str) -> None:
            body = self._body() if self.command == "POST" else b""
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "GIT_PROJECT_ROOT": str(srv.root / "git"),
                "GIT_HTTP_EXPORT_ALL": "1",
                "REQUEST_METHOD": self.command,
                "PATH_INFO": path.removeprefix("/git"),
                "QUERY_STRING": query,
                "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                "CONTENT_LENGTH": str(len(body)),
                "REMOTE_ADDR": "127.0.0.1",
                "GATEWAY_INTERFACE": "CGI/1.1",
                "SERVER_PROTOCOL": "HTTP/1.1",
            }
            if self.headers.get("Content-Encoding"):
                env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
            if self.headers.get("Git-Protocol"):
                env["HTTP_GIT_PROTOCOL"] = self.headers["Git-Protocol"]
            out = subprocess.run([GIT_BACKEND], input=body, env=env, capture_output=True, timeout=120).stdout
            head, _, payload = out.partition(b"\r\n\r\n")
            if not _:
                head, _, payload = out.partition(b"\n\n")
            status, headers = 200, []
            for line in head.decode("latin-1").splitlines():
                name, _, value = line.partition(":")
                if name.lower() == "status":
                    status = int(value.strip().split()[0])
                elif name:
                    headers.append((name, value.strip()))
            self.send_response(status)
            for name, value in headers:
                if name.lower() != "content-length":
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _route

    return Handler


def client_env(proxy_url: str, home: Path) -> dict[str, str]:
    """A clean environment for a real client: only the sandbox's proxy, a private HOME, no user config."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HTTP_PROXY": proxy_url,
        "http_proxy": proxy_url,
        "HTTPS_PROXY": proxy_url,
        "https_proxy": proxy_url,
        "NO_PROXY": "",
        "no_proxy": "",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
        "UV_NO_CONFIG": "1",
        "UV_CACHE_DIR": str(home / "uv-cache"),
        "UV_PYTHON_DOWNLOADS": "never",
        "npm_config_cache": str(home / "npm-cache"),
        "npm_config_userconfig": str(home / ".npmrc"),
        "npm_config_globalconfig": str(home / "global-npmrc"),
        "npm_config_update_notifier": "false",
        "npm_config_audit": "false",
        "npm_config_fund": "false",
        "npm_config_fetch_retries": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.test",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.test",
    }
