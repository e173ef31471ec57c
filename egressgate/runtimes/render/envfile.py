"""An admission (the JSON of POST /v1/sandboxes) rewritten for a workload in another network
namespace: a container, a pod, a VM.

The rewrite itself (proxy, CA variables, NO_PROXY) is runtimes/admitenv.py's, shared with `sandbox
run`. EGRESSGATE_SANDBOX_ID/TOKEN are emitted separately for deployments that build the proxy URL
themselves (the Kubernetes Pod does, from the gateway Service's address).
"""

from __future__ import annotations

from egressgate.runtimes.admitenv import rewrite_env
from egressgate.runtimes.render.common import RenderError


def inside_env(admission: dict, *, proxy: str | None, ca_path: str) -> dict[str, str]:
    """The workload's environment (runtimes/admitenv.py: the one rewrite); `proxy` is "host:port" as seen
    from inside, or None to leave the proxy variables out (the deployment sets them)."""
    try:
        sandbox_id, token, env = str(admission["id"]), str(admission["token"]), dict(admission["env"])
    except (KeyError, TypeError, ValueError):
        raise RenderError("the admission JSON needs 'id', 'token' and 'env'") \
            from None
    target = None
    if proxy is not None:
        host, sep, port = proxy.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise RenderError(f"--proxy must be HOST:PORT as the workload reaches the gateway, got {proxy!r}")
        target = (host, int(port))
    return rewrite_env(env, sandbox_id=sandbox_id, token=token, proxy=target, ca_path=ca_path)


def env_file(env: dict[str, str]) -> str:
    """KEY=VALUE lines (docker --env-file, kubectl --from-env-file, `set -a; . FILE`): values are
    refused when a line could not carry them unchanged."""
    lines = []
    for key, value in env.items():
        if "\n" in value or "\r" in value or not key.replace("_", "").isalnum():
            raise RenderError(f"{key} cannot be written as one KEY=VALUE line")
        lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"

