"""`runtime render kubernetes`: the gateway's objects — ConfigMap, StatefulSet, Services, NetworkPolicy and
PodDisruptionBudget — and the hardening every egressgate pod gets.

Why a StatefulSet: each replica writes its own hash-chained audit trail (and keeps its admin token and local
keys) in its var dir. On an `emptyDir` the trail died with the pod, before anyone shipped or verified it; a
volume claim per replica keeps it across rescheduling, and the stable pod names keep one chain per replica.

Why a metrics listener: the admin API stays on loopback (whoever reaches it with its token can admit sandboxes
under any policy). Prometheus and the kubelet's probes get `listen.metrics` (admin/metrics_listener.py): GET
/metrics with a scraper-only token from the Secret `egressgate-metrics-token`, public /healthz and /readyz.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import yaml

from egressgate.runtimes.render.common import (
    CONFIG_DIR,
    CONTAINER_TMP,
    DNS_PORT,
    NONROOT_UID,
    POLICY_DIR,
    PROXY_PORT,
    VAR_DIR,
    RenderContext,
    gateway_config,
)
from egressgate.runtimes.render.kubernetes_redis import gateway_to_redis, redis_url

GATEWAY = "egressgate-gateway"
GATEWAY_PODS = "egressgate-gateway-pods"  # the headless Service: the StatefulSet's identity, Prometheus' targets
GATEWAY_LABELS = {"app.kubernetes.io/name": "egressgate", "app.kubernetes.io/component": "gateway"}
CA_SECRET = "egressgate-ca"  # noqa: S105 - a Secret's name; the gateway CA (key + cert), created by the operator from `egressgate ca path`
METRICS_SECRET = "egressgate-metrics-token"  # noqa: S105 - a Secret's name; key `token`, created by the operator
METRICS_PORT = 9090
METRICS_MOUNT = "/run/egressgate-metrics"


@dataclass(frozen=True)
class GatewaySizing:
    """The operator's choices for the gateway pods (flags of `runtime render kubernetes`)."""

    replicas: int = 2
    workers: int = 1
    cpu_millis: int | None = None  # limit; default 1000 per worker
    memory_mb: int | None = None  # request = limit; default 512 per worker
    var_size: str = "10Gi"  # each replica's var volume: audit trail, admin token, keys
    storage_class: str | None = None  # None: the cluster's default StorageClass
    metrics_namespace: str = "monitoring"  # where Prometheus runs (the only namespace that may scrape)

    @property
    def cpu_limit(self) -> int:
        return self.cpu_millis or 1000 * self.workers

    @property
    def memory_limit(self) -> int:
        return self.memory_mb or 512 * self.workers


def container_security(read_only_root: bool) -> dict:
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


def pod_security() -> dict:
    return {"runAsNonRoot": True, "runAsUser": NONROOT_UID, "runAsGroup": NONROOT_UID, "fsGroup": NONROOT_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def gateway_configmap(ctx: RenderContext, namespace: str) -> dict:
    cfg = gateway_config()
    # Only this policy's agents can reach the resolver (gateway NetworkPolicy), and their pod IPs are
    # not known at admission: name them by the policy instead of refusing every lookup.
    cfg["dns"] = {"unknown_client_policy": ctx.name}
    # every replica (and worker) shares sandboxes, budgets and revocations through Redis
    cfg["state"] = {"backend": "redis", "url": redis_url(namespace)}
    cfg["listen"]["metrics"] = f"0.0.0.0:{METRICS_PORT}"
    cfg["admin"] = {"metrics_token_file": f"{METRICS_MOUNT}/token"}
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": GATEWAY, "namespace": namespace, "labels": GATEWAY_LABELS},
        "data": {"gateway.yaml": yaml.safe_dump(cfg, sort_keys=False), ctx.policy_file: ctx.policy_text},
    }


def _probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "metrics"}, "periodSeconds": period, "timeoutSeconds": 3,
            "failureThreshold": failures}


def _gateway_container(ctx: RenderContext, sizing: GatewaySizing) -> dict:
    return {
        "name": "gateway", "image": ctx.image,
        "args": ["run", "--config", f"{CONFIG_DIR}/gateway.yaml", "--workers", str(sizing.workers)],
        "ports": [
            {"name": "proxy", "containerPort": PROXY_PORT, "protocol": "TCP"},
            {"name": "dns", "containerPort": DNS_PORT, "protocol": "UDP"},
            {"name": "dns-tcp", "containerPort": DNS_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        # start-up (CA, policies, Redis, workers) may take a while; then /readyz gates traffic (Redis, audit
        # sink, broker) and /healthz restarts a gateway whose event loop stopped answering for a minute
        "startupProbe": _probe("/healthz", 2, 60),
        "readinessProbe": _probe("/readyz", 5, 2),
        "livenessProbe": _probe("/healthz", 10, 6),
        # memory request = limit: a gateway evicted under node pressure drops every agent's connections
        "resources": {"requests": {"cpu": f"{max(100, sizing.cpu_limit // 4)}m", "memory": f"{sizing.memory_limit}Mi"},
                      "limits": {"cpu": f"{sizing.cpu_limit}m", "memory": f"{sizing.memory_limit}Mi"}},
        "securityContext": container_security(True),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "var", "mountPath": VAR_DIR},
            {"name": "tmp", "mountPath": CONTAINER_TMP},
            {"name": "metrics-token", "mountPath": METRICS_MOUNT, "readOnly": True},
        ],
    }


def gateway_statefulset(ctx: RenderContext, namespace: str, sizing: GatewaySizing) -> dict:
    ca_dir = f"{VAR_DIR}/ca"
    copy_ca = f"mkdir -p -m 700 {ca_dir} && cp /run/egressgate-ca/*.pem {ca_dir}/ && chmod 600 {ca_dir}/*.pem"
    claim: dict = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": sizing.var_size}}}
    if sizing.storage_class:
        claim["storageClassName"] = sizing.storage_class
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": GATEWAY, "namespace": namespace, "labels": GATEWAY_LABELS},
        "spec": {
            # replicas share their state in Redis; the Service spreads agents over them
            "replicas": sizing.replicas,
            "serviceName": GATEWAY_PODS,
            "podManagementPolicy": "Parallel",  # replicas are peers: no need to start them one by one
            "selector": {"matchLabels": GATEWAY_LABELS},
            "template": {
                "metadata": {"labels": GATEWAY_LABELS},
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security(),
                    "terminationGracePeriodSeconds": 45,  # workers finish flows and flush the trail (30 s)
                    "initContainers": [{
                        "name": "ca", "image": ctx.image, "command": ["sh", "-c", copy_ca],
                        "resources": {"requests": {"cpu": "50m", "memory": "32Mi"},
                                      "limits": {"cpu": "200m", "memory": "64Mi"}},
                        "securityContext": container_security(True),
                        "volumeMounts": [{"name": "ca", "mountPath": "/run/egressgate-ca", "readOnly": True},
                                         {"name": "var", "mountPath": VAR_DIR}],
                    }],
                    "containers": [_gateway_container(ctx, sizing)],
                    "volumes": [
                        {"name": "config", "configMap": {"name": GATEWAY, "items": [
                            {"key": "gateway.yaml", "path": "gateway.yaml"},
                            {"key": ctx.policy_file, "path": f"{POLICY_DIR.removeprefix(CONFIG_DIR + '/')}/"
                                                             f"{ctx.policy_file}"},
                        ]}},
                        {"name": "ca", "secret": {"secretName": CA_SECRET, "defaultMode": 0o400}},
                        # 0440 + fsGroup: the gateway (uid 65532) reads it; the gateway refuses a world-readable one
                        {"name": "metrics-token", "secret": {"secretName": METRICS_SECRET, "defaultMode": 0o440,
                                                             "items": [{"key": "token", "path": "token"}]}},
                        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
                    ],
                },
            },
            "volumeClaimTemplates": [{"metadata": {"name": "var", "labels": GATEWAY_LABELS}, "spec": claim}],
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


def gateway_pods_service(namespace: str) -> dict:
    """Headless: one DNS name per replica, and the endpoints Prometheus' `endpoints` discovery scrapes one by
    one (a ClusterIP would hand each scrape to a random replica and mix their series)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": GATEWAY_PODS, "namespace": namespace, "labels": GATEWAY_LABELS},
            "spec": {"clusterIP": "None", "selector": GATEWAY_LABELS,
                     "ports": [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics",
                                "protocol": "TCP"}]}}


def gateway_disruption_budget(namespace: str, replicas: int) -> list[dict]:
    """One replica at a time during voluntary disruptions (drains, upgrades). None for a single replica: a
    budget of zero would block every node drain, and one of one protects nothing."""
    if replicas < 2:
        return []
    return [{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
             "metadata": {"name": GATEWAY, "namespace": namespace, "labels": GATEWAY_LABELS},
             "spec": {"maxUnavailable": 1, "selector": {"matchLabels": GATEWAY_LABELS}}}]


def gateway_peer_ports() -> list[dict]:
    """The pod ports an agent may reach. NetworkPolicy matches the destination pod's port (after the
    Service's translation), so these are the container ports, not the Service's 53."""
    return [{"protocol": "TCP", "port": PROXY_PORT}, {"protocol": "UDP", "port": DNS_PORT},
            {"protocol": "TCP", "port": DNS_PORT}]


def gateway_network_policy(namespace: str, agents: dict[str, str], private: list[str], metrics_namespace: str) -> dict:
    """Who may reach the gateway (this policy's agents on the proxy/resolver ports; Prometheus' namespace on the
    metrics port) and where the gateway itself may go: public addresses, the cluster's DNS for its own upstream
    lookups, Redis and the policy's allow_private networks. The gateway refuses private destinations itself;
    this is the second lock. Kubelet probes come from the node and are not subject to NetworkPolicy."""
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
    scrapers = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": metrics_namespace}}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": GATEWAY, "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": GATEWAY_LABELS},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": agents}}], "ports": gateway_peer_ports()},
                        {"from": [scrapers], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]}],
            "egress": egress,
        },
    }
