"""What every deployment target shares: the policy being deployed, the gateway's in-container config, the
ports, the names of the objects, and one YAML dumper.

The gateway inside a container or pod listens on all addresses for the proxy and the resolver (its
clients are other containers) but keeps the admin API on loopback: whoever can reach the admin API can
admit sandboxes under any policy, so it is reachable only from inside the gateway's own network
namespace (`kubectl exec`, `kubectl port-forward`, or compose's `network_mode: service:gateway`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml

from egressgate.policy.compile import CompiledPolicy
from egressgate.policy.errors import PolicyError
from egressgate.policy.loader import load_policies
from egressgate.policy.model import Resources
from egressgate.policy.testcases import pick_policy
from egressgate.runtimes.admitenv import CA_ENV_VARS, NO_PROXY_VARS, PROXY_ENV_VARS  # noqa: F401 - re-exported

PROXY_PORT = 8080  # explicit proxy (HTTP_PROXY) inside the gateway container
ADMIN_PORT = 8081  # loopback only, never published
DNS_PORT = 5353  # the resolver, unprivileged inside the container (the Service maps 53 to it)
CONFIG_DIR = "/etc/egressgate"  # gateway.yaml and policies/ (read-only)
POLICY_DIR = f"{CONFIG_DIR}/policies"
VAR_DIR = "/var/lib/egressgate"  # audit, admin token, CA, keys (writable)
CONTAINER_TMP = "/tmp"  # noqa: S108 - a path inside the container: its own private tmpfs
AGENT_CA_PATH = "/etc/egressgate/ca.pem"  # the sandbox CA bundle inside an agent
NONROOT_UID = 65532  # the uid both images run as (no name needed: runAsNonRoot checks the number)
DEFAULT_IMAGE = "egressgate:0.1.0"
DEFAULT_AGENT_IMAGE = "egressgate-agent:0.1.0"


class RenderError(ValueError):
    """An input the renderer refuses, with one sentence saying what to change."""


@dataclass(frozen=True)
class RenderContext:
    """The policy being deployed and the operator's choices, validated once for every target."""

    policy: CompiledPolicy
    policy_text: str  # the file exactly as written: the gateway loads the same bytes the operator checked
    image: str = DEFAULT_IMAGE
    agent_image: str = DEFAULT_AGENT_IMAGE

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def policy_file(self) -> str:
        return f"{self.name}.yaml"

    @property
    def resources(self) -> Resources:
        return self.policy.model.sandbox.resources


def load_context(policies: str | Path, name: str, *, image: str = DEFAULT_IMAGE,
                 agent_image: str = DEFAULT_AGENT_IMAGE) -> RenderContext:
    """Load `name` from a policy file or directory with the gateway's own loader, so a bad policy is
    refused here with the same `file: key.path: message` the gateway would print at start-up."""
    compiled = pick_policy(load_policies(policies), name, str(policies))
    try:
        text = Path(compiled.source).read_text(encoding="utf-8")
    except OSError as exc:  # pragma: no cover - the loader just read it
        raise PolicyError.single(compiled.source, "<file>", f"cannot read: {exc}") from None
    for label, value in (("--image", image), ("--agent-image", agent_image)):
        if not value or any(c.isspace() for c in value):
            raise RenderError(f"{label} must be an image reference without spaces, got {value!r}")
    return RenderContext(policy=compiled, policy_text=text, image=image, agent_image=agent_image)


def gateway_config(*, broker: dict | None = None) -> dict:
    """The gateway's config inside a container (egressgate/config.py's schema; unknown keys are refused
    there, so `GatewayConfig.model_validate` in the tests keeps this in step with the code)."""
    cfg: dict = {
        "listen": {
            "proxy": f"0.0.0.0:{PROXY_PORT}",
            "admin": f"127.0.0.1:{ADMIN_PORT}",
            "dns": f"0.0.0.0:{DNS_PORT}",
        },
        "policy": POLICY_DIR,
        "var_dir": VAR_DIR,
    }
    if broker:
        cfg["broker"] = broker
    return cfg


def allowed_private(ctx: RenderContext) -> list[str]:
    """The policy's `network.allow_private` networks, normalised (the gateway's own egress may reach them)."""
    return [str(ipaddress.ip_network(n, strict=False)) for n in ctx.policy.model.network.allow_private]


def cpu_quantity(millis: int) -> str:
    return f"{millis}m"


def memory_quantity(mb: int) -> str:
    return f"{mb}Mi"


class _PlainDumper(yaml.SafeDumper):
    """No anchors/aliases: a shared list (cap_drop) is written out at each use, as a person would."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def dump_yaml(docs: list[dict]) -> str:
    """Multi-document YAML from Python data (never text templates: a policy name or an image reference
    cannot inject keys). Key order is kept as built, so the output reads like a hand-written manifest."""
    return "---\n".join(yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False, width=120)
                        for doc in docs)
