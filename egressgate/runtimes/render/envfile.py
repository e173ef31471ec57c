"""An admission (the JSON of POST /v1/sandboxes) rewritten for a workload in another network
namespace: a container, a pod, a VM.

Admission hands out the proxy URL as the gateway sees itself (often 127.0.0.1) and the CA bundle as a
path on the gateway's host. Inside a container both are wrong, and a wrong HTTP_PROXY is worse than
none: clients fall back to direct connections, which the network then has to catch. So the rewrite is
explicit: the proxy host:port the workload can reach, the CA path where the bundle is mounted, NO_PROXY
removed (an inherited one would exempt hosts from the gateway), everything else (phantom credentials)
kept as admission issued it. EGRESSGATE_SANDBOX_ID/TOKEN are emitted separately for deployments that
build the proxy URL themselves (the Kubernetes Pod does, from the gateway Service's address).
"""

from __future__ import annotations

from urllib.parse import quote

from egressgate.runtimes.render.common import CA_ENV_VARS, NO_PROXY_VARS, PROXY_ENV_VARS, RenderError


def inside_env(admission: dict, *, proxy: str | None, ca_path: str) -> dict[str, str]:
    """The workload's environment; `proxy` is "host:port" as seen from inside, or None to leave the
    proxy variables out (the deployment sets them)."""
    try:
        sandbox_id, token, env = str(admission["id"]), str(admission["token"]), dict(admission["env"])
    except (KeyError, TypeError, ValueError):
        raise RenderError("the admission JSON needs 'id', 'token' and 'env'") \
            from None
    out = {key: str(value) for key, value in env.items()
           if key not in PROXY_ENV_VARS + NO_PROXY_VARS + CA_ENV_VARS}
    out["EGRESSGATE_SANDBOX_ID"] = sandbox_id
    out["EGRESSGATE_SANDBOX_TOKEN"] = token
    if proxy is not None:
        host, sep, port = proxy.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise RenderError(f"--proxy must be HOST:PORT as the workload reaches the gateway, got {proxy!r}")
        url = f"http://{quote(sandbox_id, safe='')}:{quote(token, safe='')}@{host}:{port}"
        out.update({name: url for name in PROXY_ENV_VARS})
    out.update({name: ca_path for name in CA_ENV_VARS})
    return out


def env_file(env: dict[str, str]) -> str:
    """KEY=VALUE lines (docker --env-file, kubectl --from-env-file, `set -a; . FILE`): values are
    refused when a line could not carry them unchanged."""
    lines = []
    for key, value in env.items():
        if "\n" in value or "\r" in value or not key.replace("_", "").isalnum():
            raise RenderError(f"{key} cannot be written as one KEY=VALUE line")
        lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"

