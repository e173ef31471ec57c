"""`runtime render kubernetes`, what production needs (issue 23 item 9): HTTP probes, a metrics port Prometheus
can scrape without the admin API, resources, a disruption budget, an audit trail on a volume claim, and a
registry prefix. Every manifest set here also passes `kubernetes-validate --strict`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from egressgate.admin.metrics_listener import MetricsTokenError, read_metrics_token
from egressgate.config import GatewayConfig
from egressgate.runtimes.render.kubernetes import with_registry
from tests.render.test_kubernetes import SEED, by_kind, render, validate
from tests.support.cli import POLICIES, cli


def _gateway(docs: dict[str, list[dict]]) -> tuple[dict, dict]:
    sts = by_kind(docs, "StatefulSet", "egressgate-gateway")
    return sts, sts["spec"]["template"]["spec"]


def test_probes_and_scraping_use_the_metrics_listener_never_the_admin_api(tmp_path: Path) -> None:
    docs = render(tmp_path)
    sts, pod = _gateway(docs)
    (gateway,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert gateway["startupProbe"]["httpGet"]["port"] == "metrics"
    cfg = GatewayConfig.model_validate(yaml.safe_load(by_kind(docs, "ConfigMap")["data"]["gateway.yaml"]))
    assert cfg.listen.metrics == f"0.0.0.0:{ports['metrics']}"
    assert cfg.listen.admin.startswith("127.0.0.1:")  # the admin API is still unreachable from the network
    assert int(cfg.listen.admin.rsplit(":", 1)[1]) not in ports.values()
    # the token file the config names is the Secret's key, mounted read-only, readable by the gateway's group only
    mounts = {m["name"]: m for m in gateway["volumeMounts"]}
    token = Path(cfg.admin.metrics_token_file)
    assert mounts["metrics-token"]["mountPath"] == str(token.parent) and mounts["metrics-token"]["readOnly"]
    secret = next(v for v in pod["volumes"] if v["name"] == "metrics-token")["secret"]
    assert secret["items"] == [{"key": "token", "path": token.name}]
    assert pod["securityContext"]["fsGroup"] == gateway["securityContext"]["runAsUser"] == 65532
    # that mode is one the gateway accepts, and the positive control: a world-readable one it refuses
    path = tmp_path / "token"
    path.write_text("t" * 32)
    path.chmod(secret["defaultMode"])
    assert read_metrics_token(path) == "t" * 32
    path.chmod(0o444)
    with pytest.raises(MetricsTokenError, match="every local user"):
        read_metrics_token(path)
    # Prometheus discovers each replica through the headless Service (one series per replica, never mixed)
    pods = by_kind(docs, "Service", "egressgate-gateway-pods")
    assert pods["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "egressgate-gateway-pods"
    assert pods["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    # the agents' Service does not carry the metrics port
    assert "metrics" not in {p["name"] for p in by_kind(docs, "Service", "egressgate-gateway")["spec"]["ports"]}


def test_every_container_has_requests_and_limits(tmp_path: Path) -> None:
    docs = render(tmp_path, "--workers", "2")
    _, pod = _gateway(docs)
    (gateway,) = pod["containers"]
    assert gateway["resources"]["limits"] == {"cpu": "2000m", "memory": "1024Mi"}  # 1000m and 512Mi per worker
    assert gateway["resources"]["requests"]["memory"] == gateway["resources"]["limits"]["memory"]
    assert set(pod["initContainers"][0]["resources"]) == {"requests", "limits"}
    redis = by_kind(docs, "Deployment", "egressgate-redis")["spec"]["template"]["spec"]["containers"][0]
    assert redis["resources"]["requests"]["memory"] == redis["resources"]["limits"]["memory"]
    assert redis["livenessProbe"]["tcpSocket"] == {"port": "redis"}
    docs = render(tmp_path / "b", "--gateway-cpu-millis", "1500", "--gateway-memory-mb", "768")
    (gateway,) = _gateway(docs)[1]["containers"]
    assert gateway["resources"]["limits"] == {"cpu": "1500m", "memory": "768Mi"}


def test_a_disruption_budget_keeps_replicas_serving_through_a_drain(tmp_path: Path) -> None:
    docs = render(tmp_path, "--replicas", "3")
    pdb = by_kind(docs, "PodDisruptionBudget", "egressgate-gateway")
    sts, _ = _gateway(docs)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": sts["spec"]["selector"]["matchLabels"]}}
    # one replica: a budget would block every node drain (or protect nothing), so none is rendered
    single = render(tmp_path / "one", "--replicas", "1")
    assert not [d for ds in single.values() for d in ds if d["kind"] == "PodDisruptionBudget"]


def test_the_audit_trail_lives_on_a_volume_claim_per_replica(tmp_path: Path) -> None:
    docs = render(tmp_path, "--var-size", "50Gi", "--storage-class", "fast-ssd")
    sts, pod = _gateway(docs)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "var"
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}},
                             "storageClassName": "fast-ssd"}
    assert "var" not in {v["name"] for v in pod["volumes"]}  # not an emptyDir any more
    cfg = GatewayConfig.model_validate(yaml.safe_load(by_kind(docs, "ConfigMap")["data"]["gateway.yaml"]))
    var_mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "var")
    assert cfg.audit_path() is not None and str(cfg.audit_path()).startswith(var_mount["mountPath"] + "/")
    assert validate(sorted((tmp_path / "out").glob("*.yaml"))).returncode == 0


def test_registry_prefixes_every_image_that_names_none(tmp_path: Path) -> None:
    docs = render(tmp_path, "--registry", "registry.example.com:5000/egressgate", "--redis-image",
                  "quay.io/opstree/redis:7")
    images = []
    for ds in docs.values():
        for d in ds:
            spec = d.get("spec", {}).get("template", {}).get("spec") or (d["spec"] if d["kind"] == "Pod" else {})
            images += [c["image"] for c in spec.get("containers", []) + spec.get("initContainers", [])]
    assert sorted(images) == sorted(["quay.io/opstree/redis:7",  # names a registry: left alone
                                     "registry.example.com:5000/egressgate/egressgate:0.1.0",  # init container
                                     "registry.example.com:5000/egressgate/egressgate:0.1.0",
                                     "registry.example.com:5000/egressgate/egressgate-agent:0.1.0"])
    assert with_registry("localhost/x:1", "r.example") == "localhost/x:1"
    assert with_registry("library/redis:7", "r.example") == "r.example/library/redis:7"  # Docker Hub path
    assert with_registry("egressgate:0.1.0", None) == "egressgate:0.1.0"
    assert validate(sorted((tmp_path / "out").glob("*.yaml"))).returncode == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--var-size", "10GB"], "--var-size must be a size like 10Gi"),
    (["--registry", "Bad Registry"], "--registry 'Bad Registry' must be a registry host"),
    (["--metrics-namespace", "Bad_NS"], "--metrics-namespace 'Bad_NS' is not a DNS-1123 label"),
    (["--gateway-memory-mb", "1"], "--gateway-memory-mb must be 128..1000000"),
    (["--storage-class", "no spaces allowed"], "is not a StorageClass name"),
])
def test_bad_production_flags_fail_with_a_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    res = cli("runtime", "render", "kubernetes", "--policies", str(POLICIES), "--policy", SEED,
              "--out", str(tmp_path / "out"), *args)
    assert res.returncode == 2 and message in res.stderr, res.stdout + res.stderr
    assert not (tmp_path / "out").exists()
