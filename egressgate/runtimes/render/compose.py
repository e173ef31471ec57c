"""`runtime render compose`: the gateway, OpenBao (dev mode), Redis and one agent, where the agent's only
way out is the gateway.

Three networks, each a /24 of the benchmark range 198.18.0.0/15 (never a private range a test could not
own):
* `sandbox` (internal): the agent and the gateway. Docker gives an internal network no route out, so the
  agent reaches nothing but the gateway's proxy and resolver (its embedded DNS forwards to the gateway).
* `backend` (internal): the gateway, OpenBao and Redis; the agent is not on it.
* `egress`: the gateway alone, its way to the upstreams.
The admin API stays on the gateway's loopback; the one-shot `admit` service shares the gateway's network
namespace (`network_mode: service:gateway`) and its var volume (admin token) to admit the agent, and
writes the agent's environment and CA bundle to a volume the agent mounts read-only. The agent never
sees the admin token, the gateway's CA key or OpenBao's token.
"""

from __future__ import annotations

import ipaddress

import yaml

from egressgate.runtimes.render.common import (
    ADMIN_PORT,
    CONFIG_DIR,
    CONTAINER_TMP,
    NONROOT_UID,
    POLICY_DIR,
    PROXY_PORT,
    VAR_DIR,
    RenderContext,
    RenderError,
    dump_yaml,
    gateway_config,
)

OPENBAO_DEV_TOKEN = "egressgate-dev-root"  # noqa: S105 - OpenBao dev mode only; documented as such
OPENBAO_INIT = ("(bao secrets list | grep -q '^transit/' || bao secrets enable transit)"
                " && bao write -f transit/keys/egressgate-jwt type=ed25519"
                " && bao write -f transit/keys/egressgate-audit type=ed25519")
AGENT_ENV_DIR = "/run/egressgate-agent"
DEFAULT_BASE = "198.18.64.0/22"  # egress .64, backend .65, sandbox .66
HARDENED = {"cap_drop": ["ALL"], "security_opt": ["no-new-privileges:true"]}
GATEWAY_WORKERS = 2  # `run --workers`: one gateway container, two processes on its listeners
GATEWAY_LIMITS = {"mem_limit": "1g", "memswap_limit": "1g", "cpus": float(GATEWAY_WORKERS), "pids_limit": 512}
SECRETS_DIR = "/run/egressgate-secrets"
# The Redis password, made once on the first `up` inside the stack (never in compose.yaml, gateway.yaml or
# a command line): redis.conf is redis-server's config file argument, redis.password the
# gateway's state.password_file. Written to temp names and renamed, the password file last: it marks done.
SECRETS_INIT = (
    "import os, secrets\n"
    f"d = {SECRETS_DIR!r}\n"
    "if not os.path.exists(d + '/redis.password'):\n"
    "    pw = secrets.token_urlsafe(32)\n"
    "    for name, text in (('redis.conf', 'requirepass ' + pw + '\\n'), ('redis.password', pw + '\\n')):\n"
    "        fd = os.open(d + '/' + name + '.tmp', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)\n"
    "        os.write(fd, text.encode())\n"
    "        os.fsync(fd)\n"
    "        os.close(fd)\n"
    "        os.replace(d + '/' + name + '.tmp', d + '/' + name)\n"
)


def subnets(base: str) -> dict[str, ipaddress.IPv4Network]:
    try:
        net = ipaddress.ip_network(base, strict=True)
    except ValueError as exc:
        raise RenderError(f"--subnet {base!r} is not a network with prefix: {exc}") from None
    bench = ipaddress.ip_network("198.18.0.0/15")
    if net.version != 4 or net.prefixlen > 22 or not net.subnet_of(bench):
        raise RenderError(f"--subnet must be a /22 or larger inside {bench} (addresses nobody else owns), "
                          f"got {base!r}")
    egress, backend, sandbox = list(net.subnets(new_prefix=24))[:3]
    return {"egress": egress, "backend": backend, "sandbox": sandbox}


def addresses(nets: dict[str, ipaddress.IPv4Network]) -> dict[str, str]:
    """Fixed addresses: the agent's is registered at admission (its resolver identity), the gateway's
    is the agent's proxy and resolver."""
    at = {name: list(net.hosts()) for name, net in nets.items()}
    return {"gateway.egress": str(at["egress"][1]), "gateway.backend": str(at["backend"][1]),
            "gateway.sandbox": str(at["sandbox"][1]), "openbao": str(at["backend"][2]),
            "redis": str(at["backend"][3]), "agent": str(at["sandbox"][9])}


def compose_gateway_config(ip: dict[str, str]) -> dict:
    cfg = gateway_config(broker={"backend": "vault", "vault_addr": f"http://{ip['openbao']}:8200", "auth": "token"})
    # port 53: Docker's `dns:` option takes addresses only; the container may bind it through the
    # namespaced sysctl below, without any capability
    cfg["listen"]["dns"] = "0.0.0.0:53"
    # the gateway's workers share sandboxes, budgets and revocations through Redis (and keep them
    # across a gateway restart: Redis writes its append-only file to the redis-data volume)
    cfg["state"] = {"backend": "redis", "url": f"redis://{ip['redis']}:6379/0",
                    "password_file": f"{SECRETS_DIR}/redis.password"}
    return cfg


def _build(target: str) -> dict:
    return {"context": ".", "dockerfile": "Dockerfile.offline", "target": target}  # scripts/build-images.sh


def compose_file(ctx: RenderContext, nets: dict[str, ipaddress.IPv4Network], config_dir: str) -> dict:
    ip = addresses(nets)
    sandbox = ctx.policy.model.sandbox
    res = sandbox.resources
    gateway_mounts = [f"{config_dir}/gateway.yaml:{CONFIG_DIR}/gateway.yaml:ro",
                      f"{config_dir}/policies/{ctx.policy_file}:{POLICY_DIR}/{ctx.policy_file}:ro",
                      f"gateway-var:{VAR_DIR}", f"egressgate-secrets:{SECRETS_DIR}:ro"]
    agent: dict = {
        "image": ctx.agent_image, "build": _build("agent"),
        "depends_on": {"admit": {"condition": "service_completed_successfully"}},
        # the environment admission issued, rewritten for this network (proxy = the gateway's sandbox
        # address), loaded at start; docker exec users source the same file
        "entrypoint": ["sh", "-c", f'set -a && . {AGENT_ENV_DIR}/agent.env && set +a && exec "$$@"', "agent"],
        "command": ["sleep", "infinity"],
        "user": f"{NONROOT_UID}:{NONROOT_UID}",
        "read_only": sandbox.root_fs == "read_only",
        "tmpfs": [f"{CONTAINER_TMP}:size={sandbox.tmp.max_bytes}"],  # sandbox.tmp.max_bytes (docker's tmpfs)
        "dns": [ip["gateway.sandbox"]],
        "volumes": [f"agent-env:{AGENT_ENV_DIR}:ro"],
        "networks": {"sandbox": {"ipv4_address": ip["agent"]}},
        # no IPv6 at all: the bridge's link-local address would be a way to the host's [::] services
        "sysctls": {"net.ipv6.conf.all.disable_ipv6": 1, "net.ipv6.conf.default.disable_ipv6": 1},
        "init": True,
        **HARDENED,
    }
    if sandbox.workspace is not None:
        agent["volumes"].append(f"workspace:{sandbox.workspace.path}")
        agent["working_dir"] = sandbox.workspace.path
    if res.memory_mb:
        agent["mem_limit"] = f"{res.memory_mb}m"
        agent["memswap_limit"] = f"{res.memory_mb}m"  # no swap: the limit is the limit
    if res.pids_max:
        agent["pids_limit"] = res.pids_max
    if res.cpu_millis:
        agent["cpus"] = res.cpu_millis / 1000
    admit_cmd = ["runtime", "admit", "--config", f"{CONFIG_DIR}/gateway.yaml", "--policy", ctx.name,
                 "--address", ip["agent"], "--proxy", f"{ip['gateway.sandbox']}:{PROXY_PORT}",
                 "--ca", f"{AGENT_ENV_DIR}/ca.pem", "--format", "shell", "--out", f"{AGENT_ENV_DIR}/agent.env",
                 "--ca-out", f"{AGENT_ENV_DIR}/ca.pem"]
    services = {
        "openbao": {
            "image": "egressgate-openbao:0.1.0", "build": _build("openbao"),
            "command": ["server", "-dev", "-dev-listen-address=0.0.0.0:8200",
                        f"-dev-root-token-id={OPENBAO_DEV_TOKEN}"],
            "environment": {"HOME": CONTAINER_TMP, "BAO_ADDR": "http://127.0.0.1:8200"},
            "healthcheck": {"test": ["CMD", "bao", "status"], "interval": "2s", "timeout": "2s", "retries": 30},
            "user": f"{NONROOT_UID}:{NONROOT_UID}", "read_only": True, "tmpfs": [CONTAINER_TMP],
            "networks": {"backend": {"ipv4_address": ip["openbao"]}}, **HARDENED,
        },
        # dev mode starts empty: the gateway needs the transit engine and its two Ed25519 keys (JWT
        # signing, audit checkpoints) before it starts (it refuses a config whose keys it cannot use)
        "openbao-init": {
            "image": "egressgate-openbao:0.1.0", "build": _build("openbao"),
            "entrypoint": ["sh", "-c", OPENBAO_INIT],
            "environment": {"HOME": CONTAINER_TMP, "BAO_ADDR": f"http://{ip['openbao']}:8200",
                            "BAO_TOKEN": OPENBAO_DEV_TOKEN},
            "depends_on": {"openbao": {"condition": "service_healthy"}},
            "user": f"{NONROOT_UID}:{NONROOT_UID}", "read_only": True, "tmpfs": [CONTAINER_TMP],
            "networks": {"backend": {}}, **HARDENED,
        },
        # one-shot: the Redis password (SECRETS_INIT); no network at all
        "secrets": {
            "image": ctx.image, "build": _build("gateway"),
            "entrypoint": ["python3", "-c", SECRETS_INIT],
            "network_mode": "none",
            "user": f"{NONROOT_UID}:{NONROOT_UID}", "read_only": True,
            "volumes": [f"egressgate-secrets:{SECRETS_DIR}"], **HARDENED,
        },
        "redis": {
            "image": "egressgate-redis:0.1.0", "build": _build("redis"),
            # requirepass from the generated file: only the gateway (which reads the same secret) may speak to it
            "command": ["redis-server", f"{SECRETS_DIR}/redis.conf", "--save", "", "--appendonly", "yes",
                        "--dir", "/data"],
            "depends_on": {"secrets": {"condition": "service_completed_successfully"}},
            "user": f"{NONROOT_UID}:{NONROOT_UID}", "read_only": True, "tmpfs": [CONTAINER_TMP],
            "mem_limit": "256m", "memswap_limit": "256m", "cpus": 1.0,
            "volumes": ["redis-data:/data", f"egressgate-secrets:{SECRETS_DIR}:ro"],
            "networks": {"backend": {"ipv4_address": ip["redis"]}}, **HARDENED,
        },
        "gateway": {
            "image": ctx.image, "build": _build("gateway"),
            "command": ["run", "--config", f"{CONFIG_DIR}/gateway.yaml", "--workers", str(GATEWAY_WORKERS)],
            "environment": {"EGRESSGATE_VAULT_TOKEN": OPENBAO_DEV_TOKEN},
            "depends_on": {"openbao-init": {"condition": "service_completed_successfully"},
                           "secrets": {"condition": "service_completed_successfully"},
                           "redis": {"condition": "service_started"}},
            **GATEWAY_LIMITS,
            "sysctls": {"net.ipv4.ip_unprivileged_port_start": 0},
            # healthy = a worker answers /readyz (Redis, audit sink, broker ready): with --workers the
            # supervisor binds the ports before any worker serves, so a TCP connect proves nothing
            "healthcheck": {"test": ["CMD", "python3", "-c", "import urllib.request; urllib.request.urlopen("
                                     f"'http://127.0.0.1:{ADMIN_PORT}/readyz', timeout=2)"],
                            "interval": "2s", "timeout": "3s", "retries": 60},
            "user": f"{NONROOT_UID}:{NONROOT_UID}", "read_only": True, "tmpfs": [CONTAINER_TMP],
            "volumes": gateway_mounts,
            "networks": {"sandbox": {"ipv4_address": ip["gateway.sandbox"]},
                         "backend": {"ipv4_address": ip["gateway.backend"]},
                         "egress": {"ipv4_address": ip["gateway.egress"]}},
            "init": True, **HARDENED,
        },
        "admit": {
            "image": ctx.image, "build": _build("gateway"),
            "command": admit_cmd,
            "depends_on": {"gateway": {"condition": "service_healthy"}},
            "network_mode": "service:gateway",  # the admin API is on the gateway's loopback only
            "user": f"{NONROOT_UID}:{NONROOT_UID}", "read_only": True,
            "volumes": [f"{config_dir}/gateway.yaml:{CONFIG_DIR}/gateway.yaml:ro",
                        f"gateway-var:{VAR_DIR}:ro", f"agent-env:{AGENT_ENV_DIR}"],
            **HARDENED,
        },
        "agent": agent,
    }
    networks: dict = {}
    for name, net in nets.items():
        networks[name] = {"internal": name != "egress", "ipam": {"config": [{"subnet": str(net)}]}}
        if name != "egress":
            # `internal` alone is enforced by dockerd's iptables rules; a dockerd started without them
            # (--iptables=false) still gives the bridge an address and the containers a default route
            # to it, i.e. to every service of the host and, with forwarding on, beyond (without this,
            # tests/render/test_compose_up.py sees the metadata canary answer the agent). With no
            # address on the bridge the default route leads nowhere, whatever the daemon's firewall.
            networks[name]["driver_opts"] = {"com.docker.network.bridge.inhibit_ipv4": "true"}
    volumes = {"gateway-var": {}, "agent-env": {}, "redis-data": {}, "egressgate-secrets": {}}
    if sandbox.workspace is not None:
        volumes["workspace"] = {}
    return {"services": services, "networks": networks, "volumes": volumes}


def render_compose(ctx: RenderContext, *, subnet: str = DEFAULT_BASE,
                   config_dir: str = "./deploy/compose") -> dict[str, str]:
    """{path relative to --out: content}: compose.yaml and the gateway config + policy it mounts."""
    if not config_dir.startswith("./") or ".." in config_dir.split("/"):
        raise RenderError(f"--config-dir must be a relative path below the compose file, got {config_dir!r}")
    nets = subnets(subnet)
    rel = config_dir.removeprefix("./")
    return {
        "compose.yaml": (f"# Generated by `egressgate runtime render compose --policy {ctx.name}`; images: "
                         "scripts/build-images.sh.\n# Docs: docs/runtimes-deploy.md. Only the gateway can leave; "
                         "OpenBao runs in dev mode (not for production).\n"
                         + dump_yaml([compose_file(ctx, nets, config_dir)])),
        f"{rel}/gateway.yaml": yaml.safe_dump(compose_gateway_config(addresses(nets)), sort_keys=False),
        f"{rel}/policies/{ctx.policy_file}": ctx.policy_text,
    }
