"""`docker build .` with nothing prepared (issue 23 item 9): ./Dockerfile builds the gateway from a Python image
and PyPI, and the image it makes starts the gateway and turns healthy.

The private dockerd has no route out (tests/support/dockerd.py), so the test builds that same stage with its two
documented knobs pointed at local inputs: PYTHON_IMAGE = a Debian trixie with python3-venv and pip (what
python:3.13-slim-trixie gives; mmdebstrap'd once and cached like scripts/build-images.sh's base) and
PIP_ARGS = --no-index over a wheel directory in the build context (deploy/wheels, built on the host from
pyproject's dependencies and cached). Every RUN line of the stage runs as it would with the defaults.
The build runs with BuildKit, the builder of `docker build` since Docker Engine 23 (and of
scripts/build-images.sh): about 40% less CPU than the classic builder, which commits a layer per instruction
and copies the venv between the stages with a checksum of every file. What the classic builder (Debian's
docker.io 20.10) needs of the file is checked on the text: every stage buildable with nothing prepared, and
no BuildKit-only syntax.
Lives with test_compose_up.py in the host-heavy group (one private dockerd per run)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.support.cli import ROOT
from tests.support.dockerd import DOCKER, Dockerd

PYBASE = "egressgate-pybase:trixie"
CACHE = Path.home() / ".cache" / "egressgate" / "images"


def _mirror() -> str:
    """The machine's first Debian archive (as scripts/build-images.sh picks it)."""
    for src in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = src.read_text()
        except OSError:
            continue
        for m in re.finditer(r"^(?:URIs:|deb)\s+(https?://\S+)", text, re.M):
            if re.search(r"/debian/?$", m.group(1)):
                return m.group(1)
    return "http://deb.debian.org/debian"


def _python_base(d: Dockerd) -> str:
    if d.docker("image", "inspect", PYBASE, check=False).returncode == 0:
        return PYBASE
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / "pybase-trixie.tar"
    if not tar.exists() or tar.stat().st_size == 0:
        part = CACHE / f"pybase-trixie.tar.part.{os.getpid()}"  # another checkout's run may fill it too
        part.unlink(missing_ok=True)
        subprocess.run(["mmdebstrap", "--quiet", "--format=tar", "--variant=essential",
                        "--include=python3,python3-venv,python3-pip,ca-certificates", "trixie", str(part), _mirror()],
                       check=True, timeout=900)
        part.rename(tar)
    d.docker("import", "-c", "ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", str(tar), PYBASE, timeout=300)
    return PYBASE


def _wheels() -> Path:
    """Wheels of the runtime dependencies and the build backend, for the image's Python (3.13, as the host venv's),
    cached by the dependency list."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = [*project["project"]["dependencies"], *project["build-system"]["requires"], "wheel"]
    key = hashlib.sha256("\n".join([sys.version.split()[0], *reqs]).encode()).hexdigest()[:16]
    out = CACHE / f"standalone-wheels-{key}"
    if not (out / ".done").exists():
        # filled under a per-process name and renamed into place: another checkout's run may be reading it
        part = CACHE / f"{out.name}.part.{os.getpid()}"
        shutil.rmtree(part, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
                        "--wheel-dir", str(part), *reqs], check=True, timeout=900)
        (part / ".done").touch()
        if out.exists() and not (out / ".done").exists():  # an incomplete one left by an older version
            shutil.rmtree(out, ignore_errors=True)
        try:
            part.rename(out)
        except OSError:  # filled by another run meanwhile
            shutil.rmtree(part, ignore_errors=True)
    return out


def _context(tmp: Path, wheels: Path) -> Path:
    """The build context as a fresh clone has it (.dockerignore decides what reaches the daemon), plus the wheels."""
    ctx = tmp / "ctx"
    ctx.mkdir()
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, ctx / name)
    shutil.copytree(ROOT / "egressgate", ctx / "egressgate", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "deploy" / "wheels", ctx / "deploy" / "wheels")
    for whl in wheels.glob("*.whl"):
        shutil.copy2(whl, ctx / "deploy" / "wheels" / whl.name)
    return ctx


def _wait_for_health_event(d: Dockerd, name: str, since: str, timeout: float) -> None:
    """Until the daemon reports the container healthy or dead (`docker events`, one CLI process streaming
    the daemon's events instead of a `docker inspect` a second), or `timeout` seconds pass; the caller reads
    the state itself afterwards."""
    events = subprocess.Popen(
        [DOCKER, "events", "--since", since, "--filter", f"container={name}", "--filter", "event=health_status",
         "--filter", "event=die", "--format", "{{.Status}}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=d.env())
    assert events.stdout is not None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(events.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0 and sel.select(left):
                line = events.stdout.readline()
                if not line or line.strip() in ("health_status: healthy", "die"):
                    return
    finally:
        events.kill()
        events.wait()


# what only BuildKit parses: parser directives (`# syntax=`, `# check=`), heredocs and the instruction flags the
# classic builder refuses (`RUN --mount/--network/--security`, `COPY/ADD --link/--chmod/--parents/...`)
BUILDKIT_ONLY = re.compile(
    r"^#\s*(?:syntax|check)\s*=|<<-?[\"']?\w+|^\s*(?:RUN|COPY|ADD)\s+(?:--\S+\s+)*"
    r"--(?:mount|network|security|link|chmod|parents|exclude|checksum|keep-git-dir)\b",
    re.M | re.I,
)


def test_the_plain_dockerfile_is_the_standalone_gateway() -> None:
    """A plain `docker build .` builds ./Dockerfile's last stage, and the classic builder builds every stage of
    it: so that file holds the standalone build only (no stage FROM a base only build-images.sh makes), in
    syntax the classic builder parses (the test below builds it with BuildKit)."""
    text = (ROOT / "Dockerfile").read_text()
    assert BUILDKIT_ONLY.findall(text) == []
    # positive control: the pattern finds each kind of BuildKit-only line
    for line in ("# syntax=docker/dockerfile:1", "RUN --mount=type=cache,target=/root/.cache pip install .",
                 "COPY --link egressgate/ egressgate/", "COPY --chown=1:1 --chmod=0755 a b", "RUN <<EOF"):
        assert BUILDKIT_ONLY.search(line), line
    stages = re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M)
    assert [name for _, name in stages] == ["standalone-build", "standalone"], stages
    assert all(base == "${PYTHON_IMAGE}" for base, _ in stages), stages
    offline = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile.offline").read_text(), re.M)
    assert offline == ["gateway", "agent", "openbao", "redis"], offline
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"!pyproject.toml", "!README.md", "!LICENSE", "!deploy/wheels"} <= set(ignored)


def _docker_buildkit(d: Dockerd, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The docker CLI against `d` with BuildKit (DOCKER_BUILDKIT=1: the 20.10 CLI defaults to the classic builder)."""
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**d.env(), "DOCKER_BUILDKIT": "1"})


@pytest.mark.timeout(1800)
def test_docker_build_dot_makes_a_gateway_that_turns_healthy(dockerd: Dockerd, tmp_path: Path) -> None:
    base = _python_base(dockerd)
    ctx = _context(tmp_path, _wheels())
    tag = f"egressgate-standalone:{dockerd.sid}"
    build = _docker_buildkit(dockerd, "build", "--quiet", "--network", "none", "--build-arg", f"PYTHON_IMAGE={base}",
                             "--build-arg", "PIP_ARGS=--no-index --find-links /wheels", "-t", tag, str(ctx),
                             timeout=900)
    assert build.returncode == 0, build.stderr[-4000:]
    (info,) = json.loads(dockerd.docker("image", "inspect", tag).stdout)
    config = info["Config"]
    assert config["User"] == "65532:65532" and "/readyz" in " ".join(config["Healthcheck"]["Test"])
    assert set(config["ExposedPorts"]) == {"8080/tcp", "8082/tcp", "5353/udp", "5353/tcp", "9090/tcp"}
    assert config["Labels"]["org.opencontainers.image.title"] == "egressgate"

    policies = tmp_path / "policies"
    policies.mkdir(mode=0o755)
    (policies / "p.yaml").write_text("sandbox: {name: p}\nnetwork: {}\n")
    (policies / "p.yaml").chmod(0o644)
    name = f"egstandalone{dockerd.sid}"
    since = f"{time.time() - 1:.3f}"  # the daemon's events from before the start on (same host clock)
    started = dockerd.docker("run", "-d", "--name", name, "--network", "none", "--read-only", "--tmpfs", "/tmp",
                             "--tmpfs", "/var/lib/egressgate:uid=65532,gid=65532", "-v",
                             f"{policies}:/etc/egressgate/policies:ro", tag, check=False)
    try:
        assert started.returncode == 0, started.stderr
        _wait_for_health_event(dockerd, name, since, timeout=180)
        status = json.loads(dockerd.docker("inspect", name).stdout)[0]["State"].get("Health", {}).get("Status", "")
        logs = dockerd.docker("logs", name, check=False)
        assert status == "healthy", (status, logs.stdout[-2000:], logs.stderr[-3000:])
        # the gateway itself answered (its startup line names its listeners), not only a process that exists
        assert '"proxy": "0.0.0.0:8080"' in logs.stdout, logs.stdout[-2000:]
    finally:
        dockerd.docker("rm", "-f", name, check=False)
        dockerd.docker("image", "rm", "-f", tag, check=False)
