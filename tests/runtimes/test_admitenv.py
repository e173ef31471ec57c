"""The one rewrite of an admission's env (runtimes/admitenv.py), as both callers use it: `sandbox run`
(workload.inside_env) and `runtime admit` (render/envfile.inside_env) must hand a workload the same
variables, and neither may let anything of the caller's own environment or a NO_PROXY through."""

from __future__ import annotations

import os

import pytest

from egressgate.runtimes.base import CA_PATH_IN_SANDBOX, SandboxAddress
from egressgate.runtimes.render import envfile
from egressgate.runtimes.workload import SetupFailed, inside_env

ADDR = SandboxAddress(host_ip="198.18.128.1", sandbox_ip="198.18.128.2", prefix_len=30,
                      host_if="egVh0", sandbox_if="egVs0")
ADMISSION = {
    "id": "sbx-1", "token": "t/ok+=@x",
    "env": {"HTTP_PROXY": "http://sbx-1:t%2Fok%2B%3D%40x@127.0.0.1:8080", "HTTPS_PROXY": "http://x@127.0.0.1:8080",
            "http_proxy": "http://x@127.0.0.1:8080", "https_proxy": "http://x@127.0.0.1:8080",
            "NO_PROXY": "", "no_proxy": "", "SSL_CERT_FILE": "/host/var/ca/bundle.pem",
            "REQUESTS_CA_BUNDLE": "/host/var/ca/bundle.pem", "OPENAI_API_KEY": "egp-phantom"},
}


def test_sandbox_run_and_runtime_admit_rewrite_identically(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "egV-caller-secret")  # in the caller's env: must not leak
    monkeypatch.setenv("NO_PROXY", "*")
    run_env, bundle = inside_env(ADMISSION, ADDR, 8080, "/workspace")
    admit_env = envfile.inside_env(ADMISSION, proxy="198.18.128.1:8080", ca_path=CA_PATH_IN_SANDBOX)
    assert bundle.as_posix() == "/host/var/ca/bundle.pem"
    # the same rewrite, plus only the process defaults `sandbox run` adds
    assert {k: v for k, v in run_env.items() if k not in ("PATH", "HOME", "LANG")} == admit_env
    url = "http://sbx-1:t%2Fok%2B%3D%40x@198.18.128.1:8080"  # id/token quoted, never spliced raw
    assert {run_env[k] for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")} == {url}
    assert "NO_PROXY" not in run_env and "no_proxy" not in run_env
    assert run_env["SSL_CERT_FILE"] == run_env["CURL_CA_BUNDLE"] == CA_PATH_IN_SANDBOX
    assert run_env["OPENAI_API_KEY"] == "egp-phantom" and run_env["HOME"] == "/workspace"
    assert "egV-caller-secret" not in repr(run_env) and "/host/" not in repr(run_env)
    assert os.environ["NO_PROXY"] == "*"  # (the caller's one really was there)


@pytest.mark.parametrize(("drop", "message"), [("HTTP_PROXY", "no HTTP_PROXY"), ("SSL_CERT_FILE", "no CA bundle")])
def test_an_admission_without_proxy_or_ca_refuses_to_run(drop: str, message: str) -> None:
    admission = {**ADMISSION, "env": {k: v for k, v in ADMISSION["env"].items() if k != drop}}
    with pytest.raises(SetupFailed, match=message):
        inside_env(admission, ADDR, 8080, "/tmp")
