"""`runtime render kubernetes`: schema-valid manifests (kubernetes-validate --strict, Kubernetes 1.30) whose
agent NetworkPolicy lets the agent reach the gateway's proxy and resolver ports and nothing else."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from egressgate.config import GatewayConfig
from egressgate.runtimes.render import kubernetes as k8s
from egressgate.runtimes.render.common import DNS_PORT, PROXY_PORT, load_context
from tests.support.cli import POLICIES, cli, kubernetes_validate

SEED = "invoice-analysis"


def render(tmp_path: Path, *args: str) -> dict[str, list[dict]]:
    out = tmp_path / "out"
    res = cli("runtime", "render", "kubernetes", "--policies", str(POLICIES), "--policy", SEED,
              "--out", str(out), *args)
    assert res.returncode == 0, res.stderr
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted(out.glob("*.yaml"))}


def by_kind(docs: dict[str, list[dict]], kind: str, name: str | None = None) -> dict:
    found = [d for ds in docs.values() for d in ds if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def validate(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kubernetes_validate(), "--strict", "-k", "1.30.0", *map(str, paths)],
                          capture_output=True, text=True, check=False, timeout=120)


@pytest.mark.parametrize("runtime_class", ["gvisor", "kata"])
def test_manifests_are_valid_kubernetes_1_30(tmp_path, runtime_class):
    out = tmp_path / "out"
    res = cli("runtime", "render", "kubernetes", "--policies", str(POLICIES), "--policy", SEED,
              "--runtime-class", runtime_class, "--namespace", "agents", "--out", str(out))
    assert res.returncode == 0, res.stderr
    files = sorted(out.glob("*.yaml"))
    assert [f.name for f in files] == ["agent.yaml", "gateway.yaml"]
    checked = validate(files)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    kinds = sorted(line.split(" for resource ")[1].split()[0] for line in checked.stdout.splitlines()
                   if " passed for resource " in line)
    assert kinds == sorted(["configmap/egressgate-gateway", "statefulset/egressgate-gateway",
                            "service/egressgate-gateway", "networkpolicy/egressgate-gateway",
                            "service/egressgate-gateway-pods", "poddisruptionbudget/egressgate-gateway",
                            "deployment/egressgate-redis", "service/egressgate-redis",
                            "networkpolicy/egressgate-redis",
                            "networkpolicy/egressgate-agent-invoice-analysis",
                            "pod/egressgate-agent-invoice-analysis"])
    pod = yaml.safe_load_all((out / "agent.yaml").read_text())
    assert [d["spec"].get("runtimeClassName") for d in pod if d["kind"] == "Pod"] == [runtime_class]


def test_validator_catches_an_unknown_field(tmp_path):
    """Positive control for the test above: --strict refuses a field Kubernetes does not know, so a
    typo in a renderer cannot pass as 'valid'."""
    docs = render(tmp_path)
    pod = by_kind(docs, "Pod")
    pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True  # typo: FileSystem
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(pod))
    checked = validate([bad])
    assert checked.returncode != 0
    assert "readOnlyRootFileSystem" in checked.stdout + checked.stderr


def test_agent_network_policy_allows_only_the_gateway(tmp_path):
    docs = render(tmp_path)
    pod = by_kind(docs, "Pod")
    policy = by_kind(docs, "NetworkPolicy", "egressgate-agent-invoice-analysis")
    gateway = by_kind(docs, "StatefulSet", "egressgate-gateway")
    spec = policy["spec"]
    # it selects exactly the agent pod
    assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    assert spec["ingress"] == []  # nothing may connect to the agent
    # one egress rule: peers = the gateway pods only (no ipBlock, no namespaceSelector: no 0.0.0.0/0,
    # no cluster DNS, no metadata address, no pod of another namespace)
    assert len(spec["egress"]) == 1
    (rule,) = spec["egress"]
    assert rule["to"] == [{"podSelector": {"matchLabels": k8s.GATEWAY_LABELS}}]
    assert gateway["spec"]["template"]["metadata"]["labels"] == k8s.GATEWAY_LABELS
    assert not any("ipBlock" in peer or "namespaceSelector" in peer for peer in rule["to"])
    ports = sorted((p["protocol"], p["port"]) for p in rule["ports"])
    assert ports == sorted([("TCP", PROXY_PORT), ("UDP", DNS_PORT), ("TCP", DNS_PORT)])
    # and those ports are the gateway container's proxy and resolver (NetworkPolicy sees pod ports)
    container_ports = {(p["protocol"], p["containerPort"]): p["name"]
                       for p in gateway["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {container_ports[p] for p in ports} == {"proxy", "dns", "dns-tcp"}
    # the gateway's own config listens there, and keeps the admin API on loopback
    cfg = yaml.safe_load(by_kind(docs, "ConfigMap")["data"]["gateway.yaml"])
    listen = GatewayConfig.model_validate(cfg).listen
    assert listen.proxy.endswith(f":{PROXY_PORT}") and listen.dns.endswith(f":{DNS_PORT}")
    assert listen.admin.startswith("127.0.0.1:")
    assert all(p["containerPort"] != int(listen.admin.rsplit(":", 1)[1]) for p in
               gateway["spec"]["template"]["spec"]["containers"][0]["ports"])


def test_gateway_network_policy_admits_only_this_policys_agents(tmp_path):
    docs = render(tmp_path)
    pod = by_kind(docs, "Pod")
    spec = by_kind(docs, "NetworkPolicy", "egressgate-gateway")["spec"]
    agents, scrapers = spec["ingress"]
    assert agents["from"] == [{"podSelector": {"matchLabels": pod["metadata"]["labels"]}}]
    assert sorted((p["protocol"], p["port"]) for p in agents["ports"]) == sorted(
        [("TCP", PROXY_PORT), ("UDP", DNS_PORT), ("TCP", DNS_PORT)])
    # the only other way in: the metrics port, from Prometheus' namespace (not the agents, not the admin API)
    assert scrapers == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                        "ports": [{"protocol": "TCP", "port": 9090}]}
    public = [peer["ipBlock"] for rule in spec["egress"] for peer in rule["to"] if "ipBlock" in peer]
    v4 = next(b for b in public if b["cidr"] == "0.0.0.0/0")
    assert {"169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"} <= set(v4["except"])


def test_agent_pod_hardening_and_resources_follow_the_policy(tmp_path):
    docs = render(tmp_path)
    model = load_context(POLICIES, SEED).policy.model
    spec = by_kind(docs, "Pod")["spec"]
    (agent,) = spec["containers"]
    sc = agent["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["readOnlyRootFilesystem"] is (model.sandbox.root_fs == "read_only") is True
    assert spec["automountServiceAccountToken"] is False
    assert spec["hostNetwork"] is False and spec["restartPolicy"] == "Never"
    res = model.sandbox.resources
    assert agent["resources"]["limits"] == {"cpu": f"{res.cpu_millis}m", "memory": f"{res.memory_mb}Mi"}
    assert spec["activeDeadlineSeconds"] == res.wall_time_seconds
    workspace = next(v for v in spec["volumes"] if v["name"] == "workspace")
    assert workspace["emptyDir"]["sizeLimit"] == str(model.sandbox.workspace.max_bytes)
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["HTTPS_PROXY"] == ("http://$(EGRESSGATE_SANDBOX_ID):$(EGRESSGATE_SANDBOX_TOKEN)"
                                  "@$(EGRESSGATE_GATEWAY_SERVICE_HOST):$(EGRESSGATE_GATEWAY_SERVICE_PORT_PROXY)")
    assert env["NO_PROXY"] == "" and env["SSL_CERT_FILE"] == "/etc/egressgate/ca.pem"
    assert agent["envFrom"] == [{"secretRef": {"name": "egressgate-agent-invoice-analysis-admission"}}]
    ca = next(v for v in spec["volumes"] if v["name"] == "ca")
    assert ca["configMap"]["name"] == k8s.AGENT_CA_CONFIGMAP


def test_read_write_root_fs_is_rendered_writable(tmp_path):
    text = (POLICIES / "seed-invoice-analysis.yaml").read_text().replace("root_fs: read_only", "root_fs: read_write")
    (tmp_path / "p.yaml").write_text(text)
    res = cli("runtime", "render", "kubernetes", "--policies", str(tmp_path / "p.yaml"), "--policy", SEED)
    assert res.returncode == 0, res.stderr
    pod = next(d for d in yaml.safe_load_all(res.stdout) if d and d["kind"] == "Pod")
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False


def test_service_ip_makes_the_gateway_the_only_resolver(tmp_path):
    docs = render(tmp_path, "--service-ip", "10.96.0.53")
    spec = by_kind(docs, "Pod")["spec"]
    assert spec["dnsPolicy"] == "None" and spec["dnsConfig"] == {"nameservers": ["10.96.0.53"]}
    assert by_kind(docs, "Service", "egressgate-gateway")["spec"]["clusterIP"] == "10.96.0.53"
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["HTTP_PROXY"].endswith("@10.96.0.53:8080")
    assert validate(sorted((tmp_path / "out").glob("*.yaml"))).returncode == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--runtime-class", "runc"], "'runc' is not one of 'gvisor', 'kata'"),
    (["--namespace", "Bad_NS"], "--namespace 'Bad_NS' is not a DNS-1123 label"),
    (["--service-ip", "gateway.local"], "--service-ip 'gateway.local' is not an IP address"),
    (["--image", "has space"], "--image must be an image reference without spaces"),
    (["--policy", "nope"], "no policy named 'nope'"),
])
def test_bad_inputs_fail_with_a_clear_error(tmp_path, args, message):
    base = ["runtime", "render", "kubernetes", "--policies", str(POLICIES), "--policy", SEED, "--out",
            str(tmp_path / "out")]
    res = cli(*base, *args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_bad_policy_gives_the_loader_error_with_file_and_key_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sandbox:\n  name: broken\n  resources:\n    memory_mb: -1\n")
    res = cli("runtime", "render", "kubernetes", "--policies", str(bad), "--policy", "broken")
    assert res.returncode == 2
    assert str(bad) in res.stderr and "sandbox.resources.memory_mb" in res.stderr
    assert "Traceback" not in res.stderr


def test_replicas_share_one_redis_only_the_gateway_reaches(tmp_path):
    """N gateway replicas (each `run --workers W`) behind the one Service, all configured with the rendered
    Redis as their state store; Redis admits only the gateway pods (an agent that could write to it
    could refill its own budget), and the gateway may reach it (pod addresses are private: the gateway's
    public egress rule alone would not)."""
    from egressgate.gateway.service.workers import check_workers

    docs = render(tmp_path, "--replicas", "3", "--workers", "2", "--namespace", "agents")
    gateway = by_kind(docs, "StatefulSet", "egressgate-gateway")
    assert gateway["spec"]["replicas"] == 3
    args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--workers") + 1] == "2"
    cfg = GatewayConfig.model_validate(yaml.safe_load(by_kind(docs, "ConfigMap")["data"]["gateway.yaml"]))
    assert cfg.state.backend == "redis" and cfg.state.url == "redis://egressgate-redis.agents.svc:6379/0"
    check_workers(cfg, 2)  # the gateway would not refuse its --workers on this config
    redis = by_kind(docs, "Deployment", "egressgate-redis")
    assert redis["spec"]["replicas"] == 1
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert "--appendonly" in container["command"] and container["securityContext"]["runAsNonRoot"] is True
    service = by_kind(docs, "Service", "egressgate-redis")
    assert service["spec"]["selector"] == redis["spec"]["template"]["metadata"]["labels"]
    policy = by_kind(docs, "NetworkPolicy", "egressgate-redis")["spec"]
    assert policy["podSelector"]["matchLabels"] == service["spec"]["selector"]
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": k8s.GATEWAY_LABELS}}],
                                  "ports": [{"protocol": "TCP", "port": 6379}]}]
    assert policy["egress"] == [] and sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    egress = by_kind(docs, "NetworkPolicy", "egressgate-gateway")["spec"]["egress"]
    assert {"to": [{"podSelector": {"matchLabels": service["spec"]["selector"]}}],
            "ports": [{"protocol": "TCP", "port": 6379}]} in egress
    res = cli("runtime", "render", "kubernetes", "--policies", str(POLICIES), "--policy", SEED, "--replicas", "0")
    assert res.returncode != 0 and "--replicas must be 1..100" in res.stderr
