"""`sandbox admit|revoke` talk to the admin API with the stdlib only: failures are one clear line (no
traceback), a non-HTTP admin URL is refused before anything is opened, and an inherited HTTP(S)_PROXY is
never used for the admin call (it carries the admin token). The happy path against a running gateway is
tests/gateway/test_lifecycle.py::test_cli_admit_revoke_and_ca and scripts/check-bare-install.sh."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import yaml
from click.testing import CliRunner

from egressgate.commands import cli as main
from tests.support.env import refusing_port


def config(tmp_path) -> str:
    var = tmp_path / "var"
    var.mkdir()
    (var / "admin.token").write_text("admin-token-123\n")
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({"var_dir": str(var), "listen": {"dns": None}}))
    return str(cfg)


def test_unreachable_admin_api_is_one_clear_error(tmp_path):
    with refusing_port() as port:
        r = CliRunner().invoke(main, ["sandbox", "admit", "--config", config(tmp_path), "--admin",
                                      f"http://127.0.0.1:{port}", "--policy", "p"])
    assert r.exit_code == 1 and "admin API unreachable" in r.output and "Traceback" not in r.output


def test_non_http_admin_url_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the CLI")
    r = CliRunner().invoke(main, ["sandbox", "admit", "--config", config(tmp_path), "--admin",
                                  f"file://{secret}", "--policy", "p"])
    assert r.exit_code == 1 and "must be http(s)://" in r.output


class _Admin(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Admin.seen.append((self.path, self.headers["Authorization"], body))
        if body["policy"] == "nope":
            data, status = {"error": "unknown_policy"}, 404
        else:
            data, status = {"id": "sbx-1", "token": "t", "proxy_url": "http://x", "env": {}}, 201
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


def test_admit_ignores_inherited_proxy_and_reports_refusals(tmp_path, monkeypatch):
    # a "proxy" that records whether anything was sent to it
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(5)
    trap.settimeout(0.5)
    proxy = f"http://127.0.0.1:{trap.getsockname()[1]}"
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    server = HTTPServer(("127.0.0.1", 0), _Admin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    admin = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        cfg = config(tmp_path)
        r = CliRunner().invoke(main, ["sandbox", "admit", "--config", cfg, "--admin", admin, "--policy", "p",
                                      "--label", "a=b"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["id"] == "sbx-1"
        assert _Admin.seen[-1] == ("/v1/sandboxes", "Bearer admin-token-123",
                                   {"policy": "p", "labels": {"a": "b"}, "addresses": []})
        r = CliRunner().invoke(main, ["sandbox", "admit", "--config", cfg, "--admin", admin, "--policy", "nope"])
        assert r.exit_code == 1 and "admission refused (404)" in r.output and "unknown_policy" in r.output
        try:
            conn, _ = trap.accept()
            conn.close()
            raise AssertionError("the admin call went through the inherited proxy")
        except TimeoutError:
            pass
    finally:
        server.shutdown()
        server.server_close()
        trap.close()
