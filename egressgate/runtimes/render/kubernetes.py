"""`runtime render kubernetes`: the gateway (ConfigMap, Deployment of N replicas behind one Service,
NetworkPolicy), the Redis its replicas share (kubernetes_redis.py) and one agent Pod with the
NetworkPolicy that leaves it no way out but the gateway.

What holds the agent in, and where each rule lives:
* its NetworkPolicy: egress ONLY to the gateway pods' proxy and resolver ports (no ipBlock, no
  namespaceSelector, so no cluster DNS, no metadata address, no other pod); ingress: nothing;
* its securityContext: non-root, no capabilities (no raw sockets), no privilege escalation, seccomp,
  read-only root when the policy says `root_fs: read_only`; no service-account token (no API access);
* the gateway's NetworkPolicy: only this policy's agents may connect to it (its resolver answers
  unknown clients with this policy, which is safe only because nobody else reaches it).
The admission (sandbox id + token + phantom credentials) is a Secret the operator creates with
`egressgate runtime admit` run in the gateway pod (docs/runtimes-deploy.md); it is never rendered here.
"""

from __future__ import annotations

import ipaddress
import re

import yaml

from egressgate.runtimes.render.common import (
    AGENT_CA_PATH,
    CA_ENV_VARS,
    CONFIG_DIR,
    CONTAINER_TMP,
    DNS_PORT,
    NONROOT_UID,
    POLICY_DIR,
    PROXY_ENV_VARS,
    PROXY_PORT,
    VAR_DIR,
    RenderContext,
    RenderError,
    allowed_private,
    cpu_quantity,
    dump_yaml,
    gateway_config,
    memory_quantity,
)
from egressgate.runtimes.render.kubernetes_redis import (
    DEFAULT_REDIS_IMAGE,
    gateway_to_redis,
    redis_objects,
    redis_url,
)

GATEWAY = "egressgate-gateway"
GATEWAY_LABELS = {"app.kubernetes.io/name": "egressgate", "app.kubernetes.io/component": "gateway"}
RUNTIME_CLASSES = ("gvisor", "kata")
CA_SECRET = "egressgate-ca"  # noqa: S105 - a Secret's name; the gateway CA (key + cert), created by the operator from `egressgate ca path`
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


def _container_security(read_only_root: bool) -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_UID,
        "runAsGroup": NONROOT_UID,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_security() -> dict:
    return {"runAsNonRoot": True, "runAsUser": NONROOT_UID, "runAsGroup": NONROOT_UID, "fsGroup": NONROOT_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def gateway_configmap(ctx: RenderContext, namespace: str) -> dict:
    cfg = gateway_config()
    # Only this policy's agents can reach the resolver (gateway NetworkPolicy), and their pod IPs are
    # not known at admission: name them by the policy instead of refusing every lookup.
    cfg["dns"] = {"unknown_client_policy": ctx.name}
    # every replica (and worker) shares sandboxes, budgets and revocations through Redis
    cfg["state"] = {"backend": "redis", "url": redis_url(namespace)}
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": GATEWAY, "namespace": namespace, "labels": GATEWAY_LABELS},
        "data": {"gateway.yaml": yaml.safe_dump(cfg, sort_keys=False), ctx.policy_file: ctx.policy_text},
    }


def gateway_deployment(ctx: RenderContext, namespace: str, replicas: int = 2, workers: int = 1) -> dict:
    ca_dir = f"{VAR_DIR}/ca"
    copy_ca = f"mkdir -p -m 700 {ca_dir} && cp /run/egressgate-ca/*.pem {ca_dir}/ && chmod 600 {ca_dir}/*.pem"
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "var", "mountPath": VAR_DIR},
        {"name": "tmp", "mountPath": CONTAINER_TMP},
    ]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": GATEWAY, "namespace": namespace, "labels": GATEWAY_LABELS},
        "spec": {
            # replicas share their state in Redis; the Service spreads agents over them
            "replicas": replicas,
            "selector": {"matchLabels": GATEWAY_LABELS},
            "template": {
                "metadata": {"labels": GATEWAY_LABELS},
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(),
                    "initContainers": [{
                        "name": "ca", "image": ctx.image, "command": ["sh", "-c", copy_ca],
                        "securityContext": _container_security(True),
                        "volumeMounts": [{"name": "ca", "mountPath": "/run/egressgate-ca", "readOnly": True},
                                         {"name": "var", "mountPath": VAR_DIR}],
                    }],
                    "containers": [{
                        "name": "gateway", "image": ctx.image,
                        "args": ["run", "--config", f"{CONFIG_DIR}/gateway.yaml", "--workers", str(workers)],
                        "ports": [
                            {"name": "proxy", "containerPort": PROXY_PORT, "protocol": "TCP"},
                            {"name": "dns", "containerPort": DNS_PORT, "protocol": "UDP"},
                            {"name": "dns-tcp", "containerPort": DNS_PORT, "protocol": "TCP"},
                        ],
                        "readinessProbe": {"tcpSocket": {"port": "proxy"}, "periodSeconds": 5},
                        "securityContext": _container_security(True),
                        "volumeMounts": mounts,
                    }],
                    "volumes": [
                        {"name": "config", "configMap": {"name": GATEWAY, "items": [
                            {"key": "gateway.yaml", "path": "gateway.yaml"},
                            {"key": ctx.policy_file, "path": f"{POLICY_DIR.removeprefix(CONFIG_DIR + '/')}/"
                                                             f"{ctx.policy_file}"},
                        ]}},
                        {"name": "ca", "secret": {"secretName": CA_SECRET, "defaultMode": 0o400}},
                        {"name": "var", "emptyDir": {}},
                        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
                    ],
                },
            },
        },
    }


def gateway_service(namespace: str, service_ip: str | None) -> dict:
    spec: dict = {
        "type": "ClusterIP",
        "selector": GATEWAY_LABELS,
        "ports": [
            {"name": "proxy", "port": PROXY_PORT, "targetPort": "proxy", "protocol": "TCP"},
            {"name": "dns", "port": 53, "targetPort": "dns", "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "targetPort": "dns-tcp", "protocol": "TCP"},
        ],
    }
    if service_ip:
        spec["clusterIP"] = service_ip
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": GATEWAY, "namespace": namespace, "labels": GATEWAY_LABELS}, "spec": spec}


def _gateway_peer_ports() -> list[dict]:
    """The pod ports an agent may reach. NetworkPolicy matches the destination pod's port (after the
    Service's translation), so these are the container ports, not the Service's 53."""
    return [{"protocol": "TCP", "port": PROXY_PORT}, {"protocol": "UDP", "port": DNS_PORT},
            {"protocol": "TCP", "port": DNS_PORT}]


def agent_network_policy(ctx: RenderContext, namespace: str) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": agent_name(ctx), "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": agent_labels(ctx)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],  # nothing connects to an agent
            # the ONLY egress: the gateway pods of this namespace, proxy + resolver ports
            "egress": [{"to": [{"podSelector": {"matchLabels": GATEWAY_LABELS}}], "ports": _gateway_peer_ports()}],
        },
    }


def gateway_network_policy(ctx: RenderContext, namespace: str, private: list[str]) -> dict:
    """Who may reach the gateway (this policy's agents only) and where the gateway itself may go:
    public addresses, the cluster's DNS for its own upstream lookups, and the policy's allow_private
    networks. The gateway refuses private destinations itself; this is the second lock."""
    v4 = [str(n) for n in map(ipaddress.ip_network, private) if n.version == 4]
    v6 = [str(n) for n in map(ipaddress.ip_network, private) if n.version == 6]
    public = [
        {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8",
                                                     "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16"]}},
        {"ipBlock": {"cidr": "::/0", "except": ["fc00::/7", "fe80::/10", "::1/128"]}},
    ]
    egress = [
        {"to": public + [{"ipBlock": {"cidr": n}} for n in v4 + v6]},
        {"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
         "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
        gateway_to_redis(),
    ]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": GATEWAY, "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": GATEWAY_LABELS},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": agent_labels(ctx)}}],
                         "ports": _gateway_peer_ports()}],
            "egress": egress,
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
        "securityContext": _container_security(sandbox.root_fs == "read_only"),
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
        "securityContext": _pod_security(),
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


def check_inputs(namespace: str, runtime_class: str, service_ip: str | None, replicas: int = 2,
                 workers: int = 1) -> None:
    if not 1 <= replicas <= 100 or not 1 <= workers <= 64:
        raise RenderError(f"--replicas must be 1..100 and --workers 1..64, got {replicas} and {workers}")
    if not _DNS1123.match(namespace):
        raise RenderError(f"--namespace {namespace!r} is not a DNS-1123 label (lowercase letters, digits, '-')")
    if runtime_class not in RUNTIME_CLASSES:
        raise RenderError(f"--runtime-class must be one of {', '.join(RUNTIME_CLASSES)}, got {runtime_class!r}")
    if service_ip is not None:
        try:
            ipaddress.ip_address(service_ip)
        except ValueError:
            raise RenderError(f"--service-ip {service_ip!r} is not an IP address in the cluster's "
                              "service range") from None


def render_kubernetes(ctx: RenderContext, *, namespace: str = "egressgate", runtime_class: str = "gvisor",
                      service_ip: str | None = None, replicas: int = 2, workers: int = 1,
                      redis_image: str = DEFAULT_REDIS_IMAGE) -> dict[str, str]:
    """{file name: YAML}: gateway.yaml (Redis + gateway; apply first: the agent's env needs its Service)
    and agent.yaml."""
    check_inputs(namespace, runtime_class, service_ip, replicas, workers)
    if not redis_image or any(c.isspace() for c in redis_image):
        raise RenderError(f"--redis-image must be an image reference without spaces, got {redis_image!r}")
    gateway = [*redis_objects(namespace, redis_image, _container_security(True), _pod_security(), GATEWAY_LABELS),
               gateway_configmap(ctx, namespace), gateway_deployment(ctx, namespace, replicas, workers),
               gateway_service(namespace, service_ip), gateway_network_policy(ctx, namespace, allowed_private(ctx))]
    agent = [agent_network_policy(ctx, namespace), agent_pod(ctx, namespace, runtime_class, service_ip)]
    return {"gateway.yaml": dump_yaml(gateway), "agent.yaml": dump_yaml(agent)}
