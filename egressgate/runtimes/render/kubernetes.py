"""`runtime render kubernetes`: the gateway (kubernetes_gateway.py: ConfigMap, StatefulSet of N replicas behind
one Service, NetworkPolicy, PodDisruptionBudget), the Redis its replicas share (kubernetes_redis.py) and one agent
Pod with the NetworkPolicy that leaves it no way out but the gateway.

What holds the agent in, and where each rule lives:
* its NetworkPolicy: egress ONLY to the gateway pods' proxy and resolver ports (no ipBlock, no
  namespaceSelector, so no cluster DNS, no metadata address, no other pod); ingress: nothing;
* its securityContext: non-root, no capabilities (no raw sockets), no privilege escalation, seccomp,
  read-only root when the policy says `root_fs: read_only`; no service-account token (no API access);
* the gateway's NetworkPolicy: only this policy's agents may connect to its proxy and resolver (its resolver
  answers unknown clients with this policy, which is safe only because nobody else reaches it).
The admission (sandbox id + token + phantom credentials) is a Secret the operator creates with
`egressgate runtime admit` run in the gateway pod (docs/runtimes-deploy.md); it is never rendered here.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import replace

from egressgate.runtimes.render.common import (
    AGENT_CA_PATH,
    CA_ENV_VARS,
    CONTAINER_TMP,
    PROXY_ENV_VARS,
    PROXY_PORT,
    RenderContext,
    RenderError,
    allowed_private,
    cpu_quantity,
    dump_yaml,
    memory_quantity,
)
from egressgate.runtimes.render.kubernetes_gateway import (
    GATEWAY_LABELS,
    GatewaySizing,
    container_security,
    gateway_configmap,
    gateway_disruption_budget,
    gateway_network_policy,
    gateway_peer_ports,
    gateway_pods_service,
    gateway_service,
    gateway_statefulset,
    pod_security,
)
from egressgate.runtimes.render.kubernetes_redis import DEFAULT_REDIS_IMAGE, redis_objects

RUNTIME_CLASSES = ("gvisor", "kata")
AGENT_CA_CONFIGMAP = "egressgate-agent-ca"  # the sandbox bundle (`egressgate ca export --bundle`)
# Kubernetes publishes a Service to pods created after it as <NAME>_SERVICE_HOST / _SERVICE_PORT_<PORT>;
# `$(VAR)` in an env value expands them, so the agent reaches the proxy without cluster DNS (blocked).
SERVICE_HOST_VAR = "EGRESSGATE_GATEWAY_SERVICE_HOST"
SERVICE_PORT_VAR = "EGRESSGATE_GATEWAY_SERVICE_PORT_PROXY"
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def agent_name(ctx: RenderContext) -> str:
    # sandbox names may hold '.' and '_'; object names and label values in a Pod name may not hold '_'
    return "egressgate-agent-" + re.sub(r"[^a-z0-9-]", "-", ctx.name)[:40].strip("-")


def agent_labels(ctx: RenderContext) -> dict[str, str]:
    return {"app.kubernetes.io/name": "egressgate-agent", "app.kubernetes.io/component": "agent",
            "egressgate.io/policy": re.sub(r"[^A-Za-z0-9_.-]", "-", ctx.name)[:63]}


def admission_secret(ctx: RenderContext) -> str:
    return agent_name(ctx) + "-admission"


def agent_network_policy(ctx: RenderContext, namespace: str) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": agent_name(ctx), "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": agent_labels(ctx)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],  # nothing connects to an agent
            # the ONLY egress: the gateway pods of this namespace, proxy + resolver ports
            "egress": [{"to": [{"podSelector": {"matchLabels": GATEWAY_LABELS}}], "ports": gateway_peer_ports()}],
        },
    }


def agent_env(service_ip: str | None) -> list[dict]:
    """HTTP(S)_PROXY built from the admission Secret's id and token (envFrom) and the gateway Service's
    address; CA variables point at the mounted bundle; NO_PROXY is emptied (an inherited one would let
    a client skip the gateway for some hosts). The id (`sbx-` + hex) and token (urlsafe base64, admin/
    server.py) are spliced into the URL unquoted: neither alphabet holds a character a URL would need quoted."""
    host = service_ip or f"$({SERVICE_HOST_VAR})"
    port = str(PROXY_PORT) if service_ip else f"$({SERVICE_PORT_VAR})"
    url = f"http://$(EGRESSGATE_SANDBOX_ID):$(EGRESSGATE_SANDBOX_TOKEN)@{host}:{port}"
    env = [{"name": name, "value": url} for name in PROXY_ENV_VARS]
    env += [{"name": "NO_PROXY", "value": ""}, {"name": "no_proxy", "value": ""}]
    env += [{"name": name, "value": AGENT_CA_PATH} for name in CA_ENV_VARS]
    return env


def agent_pod(ctx: RenderContext, namespace: str, runtime_class: str, service_ip: str | None) -> dict:
    sandbox = ctx.policy.model.sandbox
    res = sandbox.resources
    limits: dict[str, str] = {}
    if res.cpu_millis:
        limits["cpu"] = cpu_quantity(res.cpu_millis)
    if res.memory_mb:
        limits["memory"] = memory_quantity(res.memory_mb)
    container: dict = {
        "name": "agent", "image": ctx.agent_image,
        "envFrom": [{"secretRef": {"name": admission_secret(ctx)}}],
        "env": agent_env(service_ip),
        "securityContext": container_security(sandbox.root_fs == "read_only"),
        "volumeMounts": [{"name": "ca", "mountPath": AGENT_CA_PATH, "subPath": "ca.pem", "readOnly": True},
                         {"name": "tmp", "mountPath": CONTAINER_TMP}],
    }
    if limits:
        container["resources"] = {"limits": limits, "requests": dict(limits)}
    volumes: list[dict] = [
        {"name": "ca", "configMap": {"name": AGENT_CA_CONFIGMAP, "items": [{"key": "ca.pem", "path": "ca.pem"}]}},
        # sandbox.tmp.max_bytes: the kubelet evicts the pod past it (as for the workspace)
        {"name": "tmp", "emptyDir": {"sizeLimit": str(sandbox.tmp.max_bytes)}},
    ]
    if sandbox.workspace is not None:
        empty: dict = {}
        if sandbox.workspace.max_bytes:
            empty["sizeLimit"] = str(sandbox.workspace.max_bytes)  # the kubelet evicts the pod past it
        volumes.append({"name": "workspace", "emptyDir": empty})
        container["volumeMounts"].append({"name": "workspace", "mountPath": sandbox.workspace.path})
        container["workingDir"] = sandbox.workspace.path
    spec: dict = {
        "runtimeClassName": runtime_class,
        "automountServiceAccountToken": False,
        "enableServiceLinks": True,  # SERVICE_HOST_VAR comes from it
        "hostNetwork": False, "hostPID": False, "hostIPC": False,
        "restartPolicy": "Never",
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": volumes,
    }
    if res.wall_time_seconds:
        spec["activeDeadlineSeconds"] = res.wall_time_seconds
    if service_ip:  # the gateway's resolver is the agent's only resolver
        spec["dnsPolicy"] = "None"
        spec["dnsConfig"] = {"nameservers": [service_ip]}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": agent_name(ctx), "namespace": namespace, "labels": agent_labels(ctx)},
            "spec": spec}


_QUANTITY = re.compile(r"^[1-9][0-9]{0,5}(Mi|Gi|Ti)$")
_REGISTRY = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?(/[a-z0-9._-]+)*$")


def with_registry(image: str, registry: str | None) -> str:
    """`image` pulled from `registry` when it names none: its first path part has no '.' or ':' and is not
    `localhost` (Docker's rule), so `egressgate:0.1.0` becomes `REG/egressgate:0.1.0` and
    `quay.io/x/redis:7` stays as it is."""
    if not registry:
        return image
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"{registry.rstrip('/')}/{image}"


def check_inputs(namespace: str, runtime_class: str, service_ip: str | None, sizing: GatewaySizing,
                 registry: str | None = None) -> None:
    if not 1 <= sizing.replicas <= 100 or not 1 <= sizing.workers <= 64:
        raise RenderError(f"--replicas must be 1..100 and --workers 1..64, got {sizing.replicas} and "
                          f"{sizing.workers}")
    for flag, value, low in (("--gateway-cpu-millis", sizing.cpu_millis, 100),
                             ("--gateway-memory-mb", sizing.memory_mb, 128)):
        if value is not None and not low <= value <= 1_000_000:
            raise RenderError(f"{flag} must be {low}..1000000, got {value}")
    if not _QUANTITY.match(sizing.var_size):
        raise RenderError(f"--var-size must be a size like 10Gi (Mi, Gi or Ti), got {sizing.var_size!r}")
    for flag, value in (("--namespace", namespace), ("--metrics-namespace", sizing.metrics_namespace)):
        if not _DNS1123.match(value):
            raise RenderError(f"{flag} {value!r} is not a DNS-1123 label (lowercase letters, digits, '-')")
    if sizing.storage_class is not None and not _REGISTRY.match(sizing.storage_class):
        raise RenderError(f"--storage-class {sizing.storage_class!r} is not a StorageClass name")
    if registry is not None and not _REGISTRY.match(registry.rstrip("/")):
        raise RenderError(f"--registry {registry!r} must be a registry host[:port][/path], e.g. "
                          "registry.example.com:5000/egressgate")
    if runtime_class not in RUNTIME_CLASSES:
        raise RenderError(f"--runtime-class must be one of {', '.join(RUNTIME_CLASSES)}, got {runtime_class!r}")
    if service_ip is not None:
        try:
            ipaddress.ip_address(service_ip)
        except ValueError:
            raise RenderError(f"--service-ip {service_ip!r} is not an IP address in the cluster's "
                              "service range") from None


def render_kubernetes(ctx: RenderContext, *, namespace: str = "egressgate", runtime_class: str = "gvisor",
                      service_ip: str | None = None, sizing: GatewaySizing | None = None,
                      redis_image: str = DEFAULT_REDIS_IMAGE, registry: str | None = None) -> dict[str, str]:
    """{file name: YAML}: gateway.yaml (Redis + gateway; apply first: the agent's env needs its Service)
    and agent.yaml."""
    sizing = sizing or GatewaySizing()
    check_inputs(namespace, runtime_class, service_ip, sizing, registry)
    if not redis_image or any(c.isspace() for c in redis_image):
        raise RenderError(f"--redis-image must be an image reference without spaces, got {redis_image!r}")
    ctx = replace(ctx, image=with_registry(ctx.image, registry), agent_image=with_registry(ctx.agent_image, registry))
    redis = redis_objects(namespace, with_registry(redis_image, registry), container_security(True), pod_security(),
                          GATEWAY_LABELS)
    gateway = [*redis, gateway_configmap(ctx, namespace), gateway_statefulset(ctx, namespace, sizing),
               gateway_service(namespace, service_ip), gateway_pods_service(namespace),
               *gateway_disruption_budget(namespace, sizing.replicas),
               gateway_network_policy(namespace, agent_labels(ctx), allowed_private(ctx), sizing.metrics_namespace)]
    agent = [agent_network_policy(ctx, namespace), agent_pod(ctx, namespace, runtime_class, service_ip)]
    return {"gateway.yaml": dump_yaml(gateway), "agent.yaml": dump_yaml(agent)}
