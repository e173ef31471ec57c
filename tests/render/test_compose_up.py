"""The repository's compose.yaml, brought up for real (Debian docker-compose 1.29, a private dockerd in a
closed namespace, images built offline by scripts/build-images.sh), proves from INSIDE the agent
container that the gateway is its only way out:

* an allowed HTTPS call through the gateway reaches the test's upstream (198.18.70.10, trustme cert);
* the metadata address (a canary the test owns at 169.254.169.254 in the namespace) is never reached:
  not directly, not through the proxy; the same canary answers the gateway container (positive control:
  a container with a route gets there);
* the upstream itself is not reachable directly (bypassing HTTPS_PROXY gets nothing).

The test's only changes to compose.yaml are an override file: the test policy (allows the upstream),
the upstream's CA for the gateway, and the upstream's name in the gateway's /etc/hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
import yaml

from egressgate.config import GatewayConfig
from tests.support.cli import ROOT
from tests.support.dockerd import Dockerd

UPSTREAM_IP = "198.18.70.10"
UPSTREAM_NAME = "upstream.egr.test"
METADATA_IP = "169.254.169.254"
PEER = str(Path(__file__).with_name("compose_peer.py"))
COMPOSE = "/usr/bin/docker-compose"  # Debian's docker-compose 1.29
AGENT_ENV = "set -a && . /run/egressgate-agent/agent.env && set +a && "

pytestmark = pytest.mark.netns


def sh(*args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stdout[-2000:]} {res.stderr[-2000:]}")
    return res


# the machine's cache directory, as the user's environment names it: dockerd.env() sets HOME to the daemon's
# temp state dir, so build-images.sh, left to its default, would cache in a directory removed at session
# end and build the Debian base (mmdebstrap) and the Python packages (pip, from PyPI) again in every session
CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "egressgate"


@pytest.fixture(scope="session")
def built_dockerd(dockerd: Dockerd) -> Dockerd:
    """The session's private dockerd (tests/support/dockerd.py: its own namespace with no route out,
    198.18/15 only) with the four images built once per session from this checkout by
    scripts/build-images.sh; its inputs (the Debian base tar, the Python packages, `bao`) come from the
    machine's cache once a run has filled it, as on a developer's machine (and the wheelhouse that
    scripts/check-bare-install.sh fills in CI)."""
    cache = {"EGRESSGATE_IMAGE_CACHE": str(CACHE_HOME / "images"),
             "EGRESSGATE_WHEELHOUSE": os.environ.get("EGRESSGATE_WHEELHOUSE", str(CACHE_HOME / "bare-wheels"))}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "build-images.sh")], capture_output=True, text=True,
                         env={**dockerd.env(), "PYTHON": sys.executable, **cache}, timeout=900, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return dockerd


def in_netns(d: Dockerd, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", d.netns, *args, check=check)


def _override(tmp: Path) -> Path:
    """Test policy + gateway config (upstream CA) + the upstream's name, layered over compose.yaml."""
    ca = trustme.CA()
    cert = ca.issue_cert(UPSTREAM_NAME)
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp / "upstream.pem"))
    ca.cert_pem.write_to_path(str(tmp / "upstream-ca.pem"))
    (tmp / "upstream-ca.pem").chmod(0o644)
    policy = yaml.safe_load((ROOT / "deploy/compose/policies/example-agent.yaml").read_text())
    policy["network"]["https"]["allow"].append({"id": "test-upstream", "host": UPSTREAM_NAME, "methods": ["GET"]})
    policy["network"]["allow_private"] = [f"{UPSTREAM_IP}/32"]
    (tmp / "policy.yaml").write_text(yaml.safe_dump(policy))
    gateway = yaml.safe_load((ROOT / "deploy/compose/gateway.yaml").read_text())
    gateway["upstream"] = {"ca_bundle": "/etc/egressgate/upstream-ca.pem"}
    GatewayConfig.model_validate(gateway)  # the override must be a config the gateway accepts
    (tmp / "gateway.yaml").write_text(yaml.safe_dump(gateway))
    for name in ("policy.yaml", "gateway.yaml"):
        (tmp / name).chmod(0o644)
    override = {"services": {
        "gateway": {
            "volumes": [f"{tmp}/gateway.yaml:/etc/egressgate/gateway.yaml:ro",
                        f"{tmp}/policy.yaml:/etc/egressgate/policies/example-agent.yaml:ro",
                        f"{tmp}/upstream-ca.pem:/etc/egressgate/upstream-ca.pem:ro"],
            "extra_hosts": [f"{UPSTREAM_NAME}:{UPSTREAM_IP}"],
        },
        "admit": {"volumes": [f"{tmp}/gateway.yaml:/etc/egressgate/gateway.yaml:ro"]},
    }}
    path = tmp / "override.yaml"
    path.write_text(yaml.safe_dump(override))
    return path


@pytest.fixture
def stack(built_dockerd: Dockerd, tmp_path: Path) -> Iterator[tuple[Dockerd, list[str], Path]]:
    d = built_dockerd
    tmp_path.chmod(0o755)
    override = _override(tmp_path)
    # the namespace's own addresses: the upstream and the metadata canary (nothing else exists there)
    in_netns(d, "ip", "addr", "add", f"{UPSTREAM_IP}/32", "dev", "lo")
    in_netns(d, "ip", "addr", "add", f"{METADATA_IP}/32", "dev", "lo")
    hits = tmp_path / "hits.log"
    hits.touch()
    peer = subprocess.Popen(["ip", "netns", "exec", d.netns, sys.executable, PEER, str(hits),
                             f"https:{UPSTREAM_IP}:443:UPSTREAM:{tmp_path}/upstream.pem:{tmp_path}/upstream.pem",
                             f"http:{METADATA_IP}:80:CANARY"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    compose = [COMPOSE, "--ansi", "never", "-p", f"egr{d.sid}", "-f", str(ROOT / "compose.yaml"), "-f", str(override)]
    try:
        assert peer.stdout.readline().strip() == "ready"
        up = sh(*compose, "up", "-d", "--no-build", check=False, timeout=300, env=d.env(), cwd=ROOT)
        if up.returncode != 0:
            logs = sh(*compose, "logs", "--no-color", check=False, env=d.env(), cwd=ROOT)
            pytest.fail(f"compose up failed: {up.stderr[-3000:]}\n{logs.stdout[-5000:]}")
        yield d, compose, hits
    finally:
        sh(*compose, "down", "-v", "--timeout", "2", check=False, timeout=180, env=d.env(), cwd=ROOT)
        peer.stdin.close()
        peer.kill()
        peer.wait()
        in_netns(d, "ip", "addr", "del", f"{UPSTREAM_IP}/32", "dev", "lo", check=False)
        in_netns(d, "ip", "addr", "del", f"{METADATA_IP}/32", "dev", "lo", check=False)


def in_service(d: Dockerd, compose: list[str], service: str, script: str) -> subprocess.CompletedProcess[str]:
    """What `docker-compose exec -T SERVICE sh -c SCRIPT` runs (the same command in the service's container,
    as its user, no TTY, no stdin), done with the docker CLI: the container is the one compose labelled with
    this project and service. Each docker-compose 1.29 call starts a Python CLI (~0.85 CPU-s); the test
    makes nine such probes, and `up`/`down` stay compose's."""
    project = compose[compose.index("-p") + 1]
    found = d.docker("ps", "-q", "--filter", f"label=com.docker.compose.project={project}",
                     "--filter", f"label=com.docker.compose.service={service}").stdout.split()
    assert len(found) == 1, f"compose service {service} of {project}: containers {found}"
    return d.docker("exec", found[0], "sh", "-c", script, check=False, timeout=60)


def hit_lines(hits: Path, name: str) -> list[str]:
    return [line for line in hits.read_text().splitlines() if line.startswith(name + " ")]


@pytest.mark.timeout(900)  # the first test of a session also builds the images (setup counts)
def test_agent_reaches_the_allowed_upstream_only_through_the_gateway(stack):
    d, compose, hits = stack
    curl = "curl -sS --connect-timeout 5 --max-time 10 "
    # allowed HTTPS through the gateway (HTTPS_PROXY + the gateway's CA from admission)
    ok = in_service(d, compose, "agent", AGENT_ENV + curl + f"https://{UPSTREAM_NAME}/allowed")
    assert ok.returncode == 0 and ok.stdout == "UPSTREAM says hello\n", ok.stdout + ok.stderr
    (seen,) = hit_lines(hits, "UPSTREAM")
    assert seen.split()[2] == "/allowed"

    # the metadata address: directly (no proxy) and through the proxy
    direct = in_service(d, compose, "agent", AGENT_ENV + curl + f"--noproxy '*' http://{METADATA_IP}/direct")
    assert direct.returncode != 0, direct.stdout
    proxied = in_service(d, compose, "agent", AGENT_ENV + curl + f"-w '\\n%{{http_code}}' http://{METADATA_IP}/proxied")
    body, _, code = proxied.stdout.rpartition("\n")
    assert code == "403" and json.loads(body)["reason"] == "metadata_endpoint", proxied.stdout + proxied.stderr
    # the upstream itself, bypassing the proxy by address
    bypass = in_service(d, compose, "agent", AGENT_ENV + curl + f"-k --noproxy '*' https://{UPSTREAM_IP}/bypass")
    assert bypass.returncode != 0, bypass.stdout
    assert hit_lines(hits, "CANARY") == []
    assert len(hit_lines(hits, "UPSTREAM")) == 1

    # the denial is audited under the agent's sandbox id (the one admission wrote into its env)
    sandbox_id = in_service(d, compose, "agent", AGENT_ENV + 'printf %s "$EGRESSGATE_SANDBOX_ID"').stdout
    audit = in_service(d, compose, "gateway", "cat /var/lib/egressgate/audit.w*.jsonl").stdout
    denials = [line for line in audit.splitlines() if "metadata_endpoint" in line]
    assert sandbox_id and denials and all(sandbox_id in line for line in denials), (sandbox_id, audit[-2000:])

    # positive control: the canary answers a container that has a route (the gateway's egress network)
    probe = ("import urllib.request as u; "
             f"print(u.urlopen('http://{METADATA_IP}/control', timeout=5).read().decode(), end='')")
    control = in_service(d, compose, "gateway", f'python3 -c "{probe}"')
    assert control.stdout == "CANARY says hello\n", control.stdout + control.stderr
    (canary,) = hit_lines(hits, "CANARY")
    assert canary.split()[2] == "/control"

    # Redis answers only with the password the stack generated: another container of the backend network
    # (the gateway's, which has the address) gets NOAUTH without it; the gateway's own state calls above
    # (admission, the audited denial) are the positive control that the password works
    redis_ip = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]["networks"]["backend"][
        "ipv4_address"]
    noauth = (f"import socket; s = socket.create_connection(('{redis_ip}', 6379), timeout=5); "
              "s.sendall(b'PING\\r\\n'); print(s.recv(200).decode().strip())")
    pinged = in_service(d, compose, "gateway", f'python3 -c "{noauth}"')
    assert pinged.stdout.startswith("-NOAUTH"), pinged.stdout + pinged.stderr


def test_the_gateway_image_says_what_it_is_and_how_it_is_healthy(built_dockerd: Dockerd) -> None:
    """OCI labels, exposed ports (never the admin port) and a HEALTHCHECK on /readyz, as `docker image inspect`
    shows them to an operator."""
    (info,) = json.loads(built_dockerd.docker("image", "inspect", "egressgate:0.1.0").stdout)
    config = info["Config"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "egressgate"
    assert labels["org.opencontainers.image.version"] == "0.1.0" and labels["org.opencontainers.image.licenses"]
    assert set(config["ExposedPorts"]) == {"8080/tcp", "8082/tcp", "5353/udp", "5353/tcp", "9090/tcp"}
    assert "/readyz" in " ".join(config["Healthcheck"]["Test"]) and config["User"] == "65532:65532"


# Run inside the gateway image: every module the gateway's own imports load from the dependencies' directory
# has a .pyc that this Python accepts (its magic number; the source's mtime and size, which the loader checks).
BYTECODE_CHECK = """
import importlib.util, os, struct, sys
import egressgate.cli, egressgate.gateway.service, mitmproxy.proxy.server, cryptography.x509, pydantic, aiohttp
site, bad, n = "/opt/egressgate/site/", [], 0
for mod in list(sys.modules.values()):
    spec = getattr(mod, "__spec__", None)
    if spec is None or not (spec.origin or "").startswith(site) or not spec.origin.endswith(".py"):
        continue
    n += 1
    try:
        head = open(spec.cached, "rb").read(16)
    except OSError:
        bad.append(spec.origin)
        continue
    st = os.stat(spec.origin)
    flags, mtime, size = struct.unpack("<III", head[4:16])
    if head[:4] != importlib.util.MAGIC_NUMBER or flags or mtime != int(st.st_mtime) & 0xFFFFFFFF or size != st.st_size:
        bad.append(spec.origin)
print(n, len(bad), *bad[:5])
"""


def test_the_gateway_image_ships_the_bytecode_of_its_dependencies(built_dockerd: Dockerd) -> None:
    """The images run read-only with PYTHONDONTWRITEBYTECODE: without .pyc files in the image, every gateway
    process (the supervisor, each worker, `runtime admit`) would compile its dependencies again at each start."""
    res = built_dockerd.docker("run", "--rm", "--network", "none", "--entrypoint", "python3", "egressgate:0.1.0",
                               "-c", BYTECODE_CHECK, check=False, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    checked, bad, *_ = res.stdout.split()
    assert int(checked) > 300 and bad == "0", res.stdout
