"""`listen.metrics` + `admin.metrics_token_file`: a read-only listener for Prometheus and probes.

The threat: a scraper's credential, or the network path it gets, must not open the admin API (admission under
any policy, revocation, reload). Each refusal below has its positive control on the admin listener."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support import cli, zygote
from tests.support.launcher import EGRESSGATE, drain, startup_info, stop_process, write_policies


def _token_file(tmp: Path, mode: int = 0o600, token: str | None = None) -> tuple[Path, str]:
    token = token if token is not None else secrets.token_urlsafe(32)
    path = tmp / "metrics.token"
    path.write_text(token + "\n")
    path.chmod(mode)
    return path, token


def _config(tmp: Path, token_file: Path | None, metrics: str | None = "127.0.0.1:0") -> Path:
    policies = write_policies(tmp / "policies", {"p": {"sandbox": {"name": "p"}, "network": {}}})
    listen = {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None}
    if metrics is not None:
        listen["metrics"] = metrics
    cfg: dict = {"listen": listen, "policy": str(policies), "var_dir": str(tmp / "var")}
    if token_file is not None:
        cfg["admin"] = {"metrics_token_file": str(token_file)}
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _call(url: str, token: str | None = None, method: str = "GET", body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, method=method, data=data)  # noqa: S310 - http:// to the test's own gateway
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def gateway(tmp_path: Path):
    token_file, token = _token_file(tmp_path)
    stderr_path = tmp_path / "gateway.stderr"
    with open(stderr_path, "w") as stderr:
        proc = zygote.popen([EGRESSGATE, "run", "--config", str(_config(tmp_path, token_file))],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, "NO_PROXY": ""})
    info = startup_info(proc, stderr_path)
    drain(proc)
    admin_token = (tmp_path / "var" / "admin.token").read_text().strip()
    try:
        yield info, token, admin_token
    finally:
        assert stop_process(proc) == 0


def test_the_metrics_token_reads_metrics_and_nothing_else(gateway) -> None:
    info, token, admin_token = gateway
    metrics, admin = f"http://{info['metrics']}", f"http://{info['admin']}"
    status, text = _call(metrics + "/metrics", token)
    assert status == 200 and "egressgate_" in text, (status, text[:300])
    assert _call(metrics + "/metrics")[0] == 401  # no token
    assert _call(metrics + "/metrics", admin_token)[0] == 401  # an operator's token is not a scraper's
    assert _call(metrics + "/metrics", token + "x")[0] == 401
    # the admin API is not on this listener, whatever the token
    for tok in (token, admin_token):
        assert _call(metrics + "/v1/sandboxes", tok)[0] == 404
        assert _call(metrics + "/v1/sandboxes", tok, "POST", {"policy": "p"})[0] in (404, 405)
        assert _call(metrics + "/v1/policies/reload", tok, "POST", {})[0] in (404, 405)
    # and the metrics token opens nothing on the admin listener
    assert _call(admin + "/v1/sandboxes", token)[0] == 401
    assert _call(admin + "/metrics", token)[0] == 401
    # positive controls: the admin token on the admin listener admits and lists
    status, text = _call(admin + "/v1/sandboxes", admin_token, "POST", {"policy": "p"})
    assert status in (200, 201), text
    assert _call(admin + "/v1/sandboxes", admin_token)[0] == 200


def test_probes_need_no_token_on_the_metrics_listener(gateway) -> None:
    info, _token, _admin = gateway
    for path in ("/healthz", "/readyz"):
        status, text = _call(f"http://{info['metrics']}{path}")
        assert status == 200, (path, status, text)
    status, text = _call(f"http://{info['metrics']}/ui/")
    assert status == 404 and json.loads(text)["error"] == "unknown_route"  # no console here either


@pytest.mark.parametrize(("token_mode", "token", "with_listener", "with_token", "why"), [
    (0o600, None, True, False, "listen.metrics and admin.metrics_token_file go together"),
    (0o600, None, False, True, "listen.metrics and admin.metrics_token_file go together"),
    (0o644, None, True, True, "lets every local user read it"),
    (0o600, "short", True, True, "shorter than 16"),
])
def test_a_bad_metrics_setup_refuses_to_start(tmp_path: Path, token_mode: int, token: str | None,
                                              with_listener: bool, with_token: bool, why: str) -> None:
    token_file, _ = _token_file(tmp_path, token_mode, token)
    cfg = _config(tmp_path, token_file if with_token else None, "127.0.0.1:0" if with_listener else None)
    res = cli.run([EGRESSGATE, "run", "--config", str(cfg)], timeout=120)
    assert res.returncode != 0 and why in res.stderr, res.stderr


def test_a_missing_token_file_is_named(tmp_path: Path) -> None:
    cfg = _config(tmp_path, tmp_path / "absent.token")
    res = cli.run([EGRESSGATE, "run", "--config", str(cfg)], timeout=120)
    assert res.returncode != 0 and "absent.token: cannot read it" in res.stderr, res.stderr


def test_listen_metrics_flag_sets_the_address(tmp_path: Path) -> None:
    token_file, token = _token_file(tmp_path)
    cfg = _config(tmp_path, token_file, metrics="192.0.2.1:9090")  # TEST-NET: binding it would fail
    stderr_path = tmp_path / "gateway.stderr"
    with open(stderr_path, "w") as stderr:
        proc = zygote.popen([EGRESSGATE, "run", "--config", str(cfg), "--listen-metrics", "127.0.0.15:0"],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    info = startup_info(proc, stderr_path)
    drain(proc)
    try:
        assert info["metrics"].startswith("127.0.0.15:")
        assert _call(f"http://{info['metrics']}/metrics", token)[0] == 200
    finally:
        assert stop_process(proc) == 0
