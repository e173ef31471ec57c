"""`egressgate runtime render kubernetes|compose|firecracker` and `egressgate runtime admit`.

Render writes deployment files for runtimes that cannot run on the operator's machine; every input is
checked here (the policy with the gateway's own loader), so a bad flag or policy is one clear error and
exit 2, never a half-written directory.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import click

from egressgate.policy.errors import PolicyError
from egressgate.runtimes.render.common import DEFAULT_AGENT_IMAGE, DEFAULT_IMAGE, RenderError, load_context

EXIT_INVALID = 2


@click.group("runtime")
def runtime() -> None:
    """Deployment files for Kubernetes, compose and Firecracker; admission for a containerised agent."""


@runtime.group("render")
def render() -> None:
    """Write validated deployment files for one policy (see docs/runtimes-deploy.md)."""


def _policy_options(fn: Callable) -> Callable:
    fn = click.option("--out", "out", type=click.Path(file_okay=False), default=None,
                      help="Directory to write into (default: print to stdout).")(fn)
    fn = click.option("--agent-image", default=DEFAULT_AGENT_IMAGE, show_default=True)(fn)
    fn = click.option("--image", default=DEFAULT_IMAGE, show_default=True, help="The egressgate image.")(fn)
    fn = click.option("--policies", "policies", default="./policies", show_default=True,
                      type=click.Path(exists=True), help="Policy file or directory holding --policy.")(fn)
    return click.option("--policy", "policy", required=True, help="Policy name (sandbox.name).")(fn)


def _emit(files: dict[str, str], out: str | None) -> None:
    if out is None:
        for name, text in files.items():
            click.echo(f"# ---- {name}")
            click.echo(text, nl=False)
        return
    root = Path(out)
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)  # a reader never sees half a manifest
        click.echo(f"wrote {path}", err=True)


def _run(build: Callable[[], dict[str, str]]) -> dict[str, str]:
    try:
        files = build()
    except (PolicyError, RenderError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    return files


@render.command("kubernetes")
@_policy_options
@click.option("--namespace", default="egressgate", show_default=True)
@click.option("--runtime-class", type=click.Choice(["gvisor", "kata"]), default="gvisor", show_default=True)
@click.option("--service-ip", default=None,
              help="Fixed ClusterIP for the gateway Service; also becomes the agent's only nameserver.")
@click.option("--replicas", default=2, show_default=True, type=int,
              help="Gateway pods behind the one Service (they share state in the rendered Redis).")
@click.option("--workers", default=1, show_default=True, type=int, help="`run --workers` in each gateway pod.")
@click.option("--redis-image", default="egressgate-redis:0.1.0", show_default=True)
@click.option("--registry", default=None,
              help="Pull every image that names no registry from here (e.g. registry.example.com/egressgate).")
@click.option("--gateway-cpu-millis", type=int, default=None, help="CPU limit of a gateway pod [1000 per worker].")
@click.option("--gateway-memory-mb", type=int, default=None,
              help="Memory request = limit of a gateway pod [512 per worker].")
@click.option("--var-size", default="10Gi", show_default=True,
              help="Each replica's volume claim for its var dir (audit trail, admin token, keys).")
@click.option("--storage-class", default=None, help="StorageClass of those claims (default: the cluster's).")
@click.option("--metrics-namespace", default="monitoring", show_default=True,
              help="The namespace whose pods (Prometheus) may scrape the gateways' metrics port.")
def render_kubernetes_cmd(policy: str, policies: str, image: str, agent_image: str, out: str | None,
                          namespace: str, runtime_class: str, service_ip: str | None, replicas: int, workers: int,
                          redis_image: str, registry: str | None, gateway_cpu_millis: int | None,
                          gateway_memory_mb: int | None, var_size: str, storage_class: str | None,
                          metrics_namespace: str) -> None:
    """Redis + gateway ConfigMap/StatefulSet/Services/NetworkPolicy/PodDisruptionBudget + agent Pod/NetworkPolicy."""
    from egressgate.runtimes.render.kubernetes import GatewaySizing, render_kubernetes

    sizing = GatewaySizing(replicas=replicas, workers=workers, cpu_millis=gateway_cpu_millis,
                           memory_mb=gateway_memory_mb, var_size=var_size, storage_class=storage_class,
                           metrics_namespace=metrics_namespace)
    _emit(_run(lambda: render_kubernetes(load_context(policies, policy, image=image, agent_image=agent_image),
                                         namespace=namespace, runtime_class=runtime_class, service_ip=service_ip,
                                         sizing=sizing, redis_image=redis_image, registry=registry)), out)


@render.command("compose")
@_policy_options
@click.option("--subnet", default="198.18.64.0/22", show_default=True,
              help="A /22 inside 198.18.0.0/15: egress, backend and sandbox /24s.")
@click.option("--config-dir", default="./deploy/compose", show_default=True,
              help="Where compose.yaml finds gateway.yaml and the policy (relative).")
def render_compose_cmd(policy: str, policies: str, image: str, agent_image: str, out: str | None,
                       subnet: str, config_dir: str) -> None:
    """compose.yaml (gateway, OpenBao dev, Redis, admit, agent) + the gateway config it mounts."""
    from egressgate.runtimes.render.compose import render_compose

    _emit(_run(lambda: render_compose(load_context(policies, policy, image=image, agent_image=agent_image),
                                      subnet=subnet, config_dir=config_dir)), out)


@render.command("firecracker")
@_policy_options
@click.option("--tap", default=None, help="Host tap device name (default: egfc-<policy>).")
@click.option("--subnet", default="198.18.128.0/30", show_default=True, help="The tap link: host .1, guest .2.")
@click.option("--kernel", default="/var/lib/egressgate/firecracker/vmlinux", show_default=True)
@click.option("--rootfs", default="/var/lib/egressgate/firecracker/rootfs.ext4", show_default=True)
@click.option("--workspace-image", default=None, help="A writable ext4 image attached as the workspace drive.")
@click.option("--gateway-proxy", default="127.0.0.1:8080", show_default=True)
@click.option("--gateway-transparent", default="127.0.0.1:8082", show_default=True)
@click.option("--gateway-dns", default="127.0.0.1:5353", show_default=True)
def render_firecracker_cmd(policy: str, policies: str, image: str, agent_image: str, out: str | None,
                           tap: str | None, subnet: str, kernel: str, rootfs: str, workspace_image: str | None,
                           gateway_proxy: str, gateway_transparent: str, gateway_dns: str) -> None:
    """vm.json (firecracker --config-file) + tap.nft (the tap's only way out is the gateway)."""
    from egressgate.runtimes.render.firecracker import render_firecracker

    _emit(_run(lambda: render_firecracker(load_context(policies, policy, image=image, agent_image=agent_image),
                                          tap=tap, subnet=subnet, kernel=kernel, rootfs=rootfs,
                                          workspace_image=workspace_image, proxy=gateway_proxy,
                                          transparent=gateway_transparent, dns=gateway_dns)), out)


@runtime.command("admit")
@click.option("--config", "config_file", type=click.Path(dir_okay=False))
@click.option("--admin", "admin", help="Admin API base URL (default: from the running gateway)")
@click.option("--policy", required=True, help="Policy name (sandbox.name)")
@click.option("--label", "labels", multiple=True, help="k=v, repeatable")
@click.option("--address", "addresses", multiple=True, help="The workload's source IP (repeatable)")
@click.option("--proxy", default=None,
              help="HOST:PORT of the proxy as the workload reaches it; omit to leave HTTP(S)_PROXY out.")
@click.option("--ca", "ca_path", default="/etc/egressgate/ca.pem", show_default=True,
              help="Where the CA bundle is mounted inside the workload.")
@click.option("--ca-out", default=None, type=click.Path(dir_okay=False), help="Also copy the CA bundle here.")
@click.option("--format", "fmt", type=click.Choice(["env-file", "shell"]), default="env-file", show_default=True)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Write here (0600) instead of stdout.")
def admit_cmd(config_file: str | None, admin: str | None, policy: str, labels: tuple[str, ...],
              addresses: tuple[str, ...], proxy: str | None, ca_path: str, ca_out: str | None, fmt: str,
              out: str | None) -> None:
    """Admit a sandbox and print its environment as seen from inside a container, pod or VM."""
    import shlex

    from egressgate.admin.cli import _config, parse_labels, request_admission
    from egressgate.runtimes.render.envfile import env_file, inside_env

    data = request_admission(_config(config_file), admin, policy, parse_labels(labels), list(addresses))
    try:
        env = inside_env(data, proxy=proxy, ca_path=ca_path)
        text = (env_file(env) if fmt == "env-file"
                else "".join(f"{key}={shlex.quote(value)}\n" for key, value in env.items()))
    except RenderError as exc:
        raise click.ClickException(str(exc)) from None
    if ca_out:
        bundle = data.get("env", {}).get("SSL_CERT_FILE")
        if not bundle:
            raise click.ClickException("the gateway handed out no CA bundle (is TLS interception off?)")
        shutil.copyfile(bundle, ca_out)
        os.chmod(ca_out, 0o644)  # public certificates only: the agent's user must read them
    if out is None:
        click.echo(text, nl=False)
        return
    fd = os.open(out + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(out + ".tmp", out)
