"""The one rewrite of an admission's environment for a workload in another network namespace (used by
`sandbox run` for every runtime and by `runtime admit` for containers, pods and VMs). Stdlib only:
`sandbox run` imports it on its start-up path.

Admission hands out the proxy URL as the gateway sees itself (often 127.0.0.1) and the CA bundle as a
path on the gateway's host; inside the sandbox both are wrong, and a wrong HTTP_PROXY is worse than none
(clients fall back to direct connections). So: the proxy URL is rebuilt from the sandbox's id and token
(URL-quoted, never spliced raw) and the address the workload reaches; every CA variable points at the
mounted bundle; NO_PROXY/no_proxy are removed (not just emptied: an inherited one would exempt hosts
from the gateway); everything else (phantom credentials) is kept exactly as admission issued it.
Nothing of the caller's own environment is ever read here.
"""

from __future__ import annotations

from urllib.parse import quote

# Every variable a client library reads for its CA bundle (admin/server.py hands out this list).
# grpcio reads only GRPC_DEFAULT_SSL_ROOTS_FILE_PATH: without it a gRPC client given the admission env
# fails the gateway's TLS with CERTIFICATE_VERIFY_FAILED.
CA_ENV_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
               "GIT_SSL_CAINFO", "PIP_CERT", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")
PROXY_ENV_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
NO_PROXY_VARS = ("NO_PROXY", "no_proxy")


def proxy_url(sandbox_id: str, token: str, host: str, port: int) -> str:
    return f"http://{quote(sandbox_id, safe='')}:{quote(token, safe='')}@{host}:{port}"


def rewrite_env(env: dict[str, object], *, sandbox_id: str, token: str, proxy: tuple[str, int] | None,
                ca_path: str) -> dict[str, str]:
    """Admission's `env` as the workload must see it; `proxy` is (host, port) as reached from inside, or
    None to leave the proxy variables out (a deployment that builds the URL itself)."""
    out = {str(key): str(value) for key, value in env.items()
           if key not in PROXY_ENV_VARS + NO_PROXY_VARS + CA_ENV_VARS}
    out["EGRESSGATE_SANDBOX_ID"] = sandbox_id
    out["EGRESSGATE_SANDBOX_TOKEN"] = token
    if proxy is not None:
        url = proxy_url(sandbox_id, token, *proxy)
        out.update({name: url for name in PROXY_ENV_VARS})
    out.update({name: ca_path for name in CA_ENV_VARS})
    return out
