"""`runtime render kubernetes`: the Redis the gateway replicas share (Deployment, Service, NetworkPolicy).

Why Redis here: every gateway replica (and every worker of `run --workers N` inside one) must see the same
sandboxes, budgets, history and revocations (`state: {backend: redis}`, docs/operations.md "Workers and
replicas"); the gateway Service then spreads agents over the replicas. Who may reach it: the gateway pods
only (its NetworkPolicy), because whoever writes to it can admit sandboxes and refill budgets. It keeps
an append-only file on an emptyDir, which survives restarts of the Redis container and of every gateway
pod; for data that must survive rescheduling of the Redis pod, mount a PersistentVolumeClaim on /data or
point `state.url` at a managed Redis (docs/runtimes-deploy.md).
"""

from __future__ import annotations

REDIS = "egressgate-redis"
REDIS_PORT = 6379
REDIS_LABELS = {"app.kubernetes.io/name": "egressgate", "app.kubernetes.io/component": "redis"}
DEFAULT_REDIS_IMAGE = "egressgate-redis:0.1.0"


def redis_url(namespace: str) -> str:
    """The gateway's `state.url`: the Service's in-cluster name (the gateway may query cluster DNS)."""
    return f"redis://{REDIS}.{namespace}.svc:{REDIS_PORT}/0"


def gateway_to_redis() -> dict:
    """The gateway NetworkPolicy's egress rule to Redis (a pod address: private, so not in its public rule)."""
    return {"to": [{"podSelector": {"matchLabels": REDIS_LABELS}}], "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}


def redis_objects(namespace: str, image: str, security: dict, pod_security: dict,
                  gateway_labels: dict[str, str]) -> list[dict]:
    """Deployment (one pod), Service and NetworkPolicy of the shared Redis."""
    meta = {"name": REDIS, "namespace": namespace, "labels": REDIS_LABELS}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # never two Redis pods on one data directory
            "selector": {"matchLabels": REDIS_LABELS},
            "template": {
                "metadata": {"labels": REDIS_LABELS},
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security,
                    "containers": [{
                        "name": "redis", "image": image,
                        "command": ["redis-server", "--port", str(REDIS_PORT), "--dir", "/data", "--appendonly", "yes",
                                    "--save", "", "--protected-mode", "no"],
                        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
                        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
                        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
                        # memory request = limit: an evicted Redis takes every replica's state with it
                        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                                      "limits": {"cpu": "1000m", "memory": "256Mi"}},
                        "securityContext": security,
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                    }],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"type": "ClusterIP", "selector": REDIS_LABELS,
                 "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}]},
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": REDIS, "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": REDIS_LABELS},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": gateway_labels}}],
                         "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}],
            "egress": [],  # Redis connects to nothing
        },
    }
    return [deployment, service, policy]
