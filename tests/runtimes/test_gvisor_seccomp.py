"""The gvisor runtime refuses to start (exit 120, one sentence, nothing created) when the daemon runs runsc
without `--oci-seccomp`: runsc would then drop the sandbox's seccomp profile with nothing but a log line.

Positive controls: on that daemon the profile really is ignored (a set-id chmod the profile refuses works
under its runsc), while under the session daemon's runsc (registered with --oci-seccomp) the same chmod is
refused and `sandbox run --runtime gvisor` runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes import seccompjson
from egressgate.runtimes.docker import labelled_containers, oci_seccomp_problem
from tests.runtimes.harness import Gateway
from tests.support.dockerd import Dockerd, running

pytestmark = pytest.mark.netns
SETUID = "touch /tmp/f && chmod 4755 /tmp/f && echo SET"


@pytest.fixture(scope="module")
def plain_dockerd() -> Iterator[Dockerd]:
    """A second private daemon whose runsc lacks --oci-seccomp (as Debian's default registration does)."""
    state = Path(tempfile.mkdtemp(prefix="egD-"))
    try:
        with running(state / "d", runsc_args=("--network=host",)) as d:
            yield d
    finally:
        shutil.rmtree(state, ignore_errors=True)


def sandbox_run(gateway: Gateway, daemon: Dockerd) -> subprocess.CompletedProcess[str]:
    argv = gateway.cmd(
        "sandbox",
        "run",
        "--config",
        str(gateway.config),
        "--policy",
        "rt-allow",
        "--runtime",
        "gvisor",
        "--image",
        daemon.busybox_image(),
        "--",
        "echo",
        "ran",
    )
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**gateway.caller_env(), "DOCKER_HOST": daemon.host},
    )


def setuid_under_runsc(daemon: Dockerd, tmp: Path) -> str:
    """The set-id chmod, as uid 65534 under the daemon's runsc with the sandbox's seccomp profile."""
    profile = tmp / "profile.json"
    profile.write_text(json.dumps(seccompjson.profile()))
    res = daemon.docker(
        "run",
        "--rm",
        "--runtime",
        "runsc",
        "--network",
        "none",
        "--user",
        "65534:65534",
        "--tmpfs",
        "/tmp:rw,mode=1777",
        "--security-opt",
        f"seccomp={profile}",
        daemon.busybox_image(),
        "sh",
        "-c",
        SETUID,
        check=False,
        timeout=120,
    )
    return res.stdout + res.stderr


def test_runsc_without_oci_seccomp_is_refused(
    gateway: Gateway, plain_dockerd: Dockerd, dockerd: Dockerd, tmp_path: Path
) -> None:
    before = set(labelled_containers(plain_dockerd.host))
    res = sandbox_run(gateway, plain_dockerd)
    assert res.returncode == 120, res.stderr
    lines = [x for x in res.stderr.splitlines() if "setup failed" in x]
    assert len(lines) == 1 and re.search(
        r"runs runtime 'runsc' without --oci-seccomp, so gVisor would ignore "
        r"the sandbox's seccomp profile; add \"--oci-seccomp\"",
        lines[0],
    ), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert set(labelled_containers(plain_dockerd.host)) == before
    # positive controls: that daemon's runsc really ignores the profile ...
    assert "SET" in setuid_under_runsc(plain_dockerd, tmp_path)
    # ... while the session daemon's (with --oci-seccomp) applies it, and gvisor runs there
    out = setuid_under_runsc(dockerd, tmp_path)
    assert "SET" not in out and "Operation not permitted" in out, out
    ok = sandbox_run(gateway, dockerd)
    assert ok.returncode == 0 and ok.stdout.strip() == "ran", ok.stderr


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        (["--network=host", "--oci-seccomp"], False),
        (["-oci-seccomp=true"], False),
        (["--oci-seccomp", "--oci-seccomp=false"], True),  # the last one wins, as in runsc's flag parsing
        (["--network=host"], True),
        ([], True),
        (None, True),  # a runtime configured without runtimeArgs (e.g. a shim's own config file): unverifiable
    ],
)
def test_oci_seccomp_problem(args: list[str] | None, refused: bool) -> None:
    entry: dict = {"path": "/usr/bin/runsc"} if args is None else {"path": "/usr/bin/runsc", "runtimeArgs": args}
    problem = oci_seccomp_problem({"Runtimes": {"runc": {"path": "runc"}, "runsc": entry}}, "runsc")
    assert (problem is not None) is refused, problem
    missing = oci_seccomp_problem({"Runtimes": {"runc": {"path": "runc"}}}, "runsc")
    assert missing is not None and "knows no runtime 'runsc'" in missing
