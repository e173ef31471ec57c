"""Persistence and restore with `--runtime docker` (issue 22 item 5): the same host-side steps as netns
(runtimes/persist.py works on the workspace before the container starts and after it is removed), with the
named workspace bind-mounted into the container. Real dockerd (the session's), real containers."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.networld import World
from tests.runtimes.harness import Gateway, running_gateway, runtime_policy
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns

POLICY = runtime_policy(
    "dk-keep",
    sandbox__workspace={"path": "/workspace", "persistent": True},
    persistence__save=["/workspace/src"],
    persistence__restore_checks=["verify_manifest_hash", "reapply_current_policy"],
)


@pytest.fixture(scope="module")
def gw(world: World) -> Iterator[Gateway]:
    with running_gateway(world, {"dk-keep": POLICY}) as g:
        yield g


def run(gw: Gateway, dockerd: Dockerd, script: str, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = gw.cmd(
        "sandbox",
        "run",
        "--config",
        str(gw.config),
        "--policy",
        "dk-keep",
        "--workspace",
        "dk",
        "--runtime",
        "docker",
        "--image",
        dockerd.python_image(),
        *extra,
        "--",
        "sh",
        "-c",
        script,
    )
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=180,
        env={**gw.caller_env(), "DOCKER_HOST": dockerd.host},
        check=False,
    )


def test_docker_saves_selection_refuses_a_tampered_restore_and_accepts_it(gw: Gateway, dockerd: Dockerd) -> None:
    data = gw.base / "var" / "workspaces" / "dk" / "data"
    first = run(gw, dockerd, "mkdir -p /workspace/src; echo v1 > /workspace/src/a; echo junk > /workspace/junk")
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in data.iterdir()) == ["src"]  # not saved: dropped
    again = run(gw, dockerd, "cat /workspace/src/a")  # positive control: an untouched restore
    assert again.returncode == 0 and again.stdout.strip() == "v1", again.stderr
    (data / "src" / "a").write_text("v2 from outside\n")
    refused = run(gw, dockerd, "cat /workspace/src/a")
    assert refused.returncode == 120 and "changed outside a run" in refused.stderr, refused.stderr
    assert refused.stdout == ""
    accepted = run(gw, dockerd, "cat /workspace/src/a", "--accept-changes")
    assert accepted.returncode == 0 and accepted.stdout.strip() == "v2 from outside", accepted.stderr
