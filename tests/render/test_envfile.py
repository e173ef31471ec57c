"""`runtime admit`'s rewrite of an admission for a workload in another network namespace: the proxy
address becomes the one the workload reaches, NO_PROXY never survives (it would exempt hosts from the
gateway), CA variables point at the mounted bundle, phantom credentials are kept as issued. The
docker-compose test runs the real command end to end; these pin the rules on every input shape."""

from __future__ import annotations

import pytest

from egressgate.runtimes.render.common import RenderError
from egressgate.runtimes.render.envfile import env_file, inside_env

ADMISSION = {
    "id": "sbx-1", "token": "t/ok+=",
    "env": {"HTTP_PROXY": "http://sbx-1:t@127.0.0.1:8080", "HTTPS_PROXY": "http://sbx-1:t@127.0.0.1:8080",
            "NO_PROXY": "*", "no_proxy": "internal.example", "SSL_CERT_FILE": "/host/var/ca/bundle.pem",
            "OPENAI_API_KEY": "egp-phantom"},
}


def test_proxy_rewritten_no_proxy_dropped_ca_moved_credentials_kept():
    env = inside_env(ADMISSION, proxy="198.18.66.2:8080", ca_path="/etc/egressgate/ca.pem")
    url = "http://sbx-1:t%2Fok%2B%3D@198.18.66.2:8080"  # the token is URL-quoted, never spliced raw
    assert {env[k] for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")} == {url}
    assert "NO_PROXY" not in env and "no_proxy" not in env
    assert env["SSL_CERT_FILE"] == env["CURL_CA_BUNDLE"] == "/etc/egressgate/ca.pem"
    assert env["OPENAI_API_KEY"] == "egp-phantom"
    assert env["EGRESSGATE_SANDBOX_ID"] == "sbx-1" and env["EGRESSGATE_SANDBOX_TOKEN"] == "t/ok+="
    assert "/host/" not in env_file(env)


def test_without_proxy_the_host_side_proxy_url_is_not_handed_on():
    env = inside_env(ADMISSION, proxy=None, ca_path="/ca.pem")
    assert not any(k.lower().endswith("_proxy") for k in env)


@pytest.mark.parametrize(("admission", "proxy", "message"), [
    ({"id": "x"}, None, "needs 'id', 'token' and 'env'"),
    (ADMISSION, "198.18.66.2", "--proxy must be HOST:PORT"),
    (ADMISSION, ":8080", "--proxy must be HOST:PORT"),
])
def test_bad_inputs_are_refused(admission, proxy, message):
    with pytest.raises(RenderError, match=message):
        inside_env(admission, proxy=proxy, ca_path="/ca.pem")


def test_a_value_that_cannot_be_one_line_is_refused():
    with pytest.raises(RenderError, match="cannot be written as one KEY=VALUE line"):
        env_file({"A": "x\nB=injected"})
