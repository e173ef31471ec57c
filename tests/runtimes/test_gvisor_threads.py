"""Threads under `--runtime gvisor` (issue 20 follow-up): the seccomp profile refuses clone3 (its flags are
in memory seccomp cannot read) with ENOSYS so that glibc falls back to clone(2), whose flags are checked.
runsc ignores the profile's errnoRet and answered EPERM, so glibc never fell back and no thread (nor
posix_spawn child) could start. The gVisor variant of the profile (seccompjson.py) refuses clone3 with
SCMP_ACT_TRACE, which answers ENOSYS where no tracer exists, and ptrace stays refused.

Adversarial: inside both runtimes, clone3, clone/unshare with namespace flags and ptrace are refused with
the same errnos while threads, a thread pool, posix_spawn and fork work. Positive controls, with the same
probe under the session daemon's runsc directly: the runc profile (the state before the fix) stops every
thread and posix_spawn there; without any profile (unconfined) clone(CLONE_NEWUSER), unshare and ptrace
succeed in both runtimes and runc answers clone3 itself (EINVAL), so the refusals are the profile's.
"""

from __future__ import annotations

import errno
import json
import platform
import subprocess
from pathlib import Path

import pytest

from egressgate.runtimes import seccompjson
from egressgate.runtimes.seccomp import ARCH_INDEX, REFUSED
from tests.runtimes.harness import Gateway, safety_net
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns
PROBE = Path(__file__).with_name("thread_probe.py").read_text()
THREADS = 8
# what the profile guarantees, identical in both runtimes
REFUSED_NOW = {
    "clone3": {"ok": False, "error": "ENOSYS"},
    "clone_newuser": {"ok": False, "error": "EPERM"},
    "clone_newnet": {"ok": False, "error": "EPERM"},
    "unshare_newuser": {"ok": False, "error": "EPERM"},
    "ptrace_attach": {"ok": False, "error": "EPERM"},
}


def numbers() -> str:
    i = ARCH_INDEX[platform.machine()]
    return json.dumps({s.name: s.nr[i] for s in REFUSED if s.name in ("clone3", "clone", "unshare", "ptrace")})


def probe_argv() -> list[str]:
    return ["python3", "-c", PROBE, numbers(), str(THREADS)]


def parse(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def sandbox_run(gateway: Gateway, dockerd: Dockerd, runtime: str) -> dict:
    argv = gateway.cmd(
        "sandbox",
        "run",
        "--config",
        str(gateway.config),
        "--policy",
        "rt-allow",
        "--runtime",
        runtime,
        "--image",
        dockerd.python_image(),
        "--",
        *probe_argv(),
    )
    res = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**gateway.caller_env(), "DOCKER_HOST": dockerd.host},
        preexec_fn=safety_net,
    )
    assert res.returncode == 0, (runtime, res.stdout, res.stderr)
    return parse(res.stdout)


def direct_run(dockerd: Dockerd, oci_runtime: str, seccomp: str) -> dict:
    """The probe as uid 65534 with no capability, under `oci_runtime` and `--security-opt seccomp=...`."""
    res = dockerd.docker(
        "run",
        "--rm",
        "--runtime",
        oci_runtime,
        "--network",
        "none",
        "--user",
        "65534:65534",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--security-opt",
        seccomp,
        dockerd.python_image(),
        *probe_argv(),
        check=False,
        timeout=300,
    )
    assert res.returncode == 0, (oci_runtime, seccomp, res.stdout, res.stderr)
    return parse(res.stdout)


def assert_threads_work(out: dict) -> None:
    assert out["threads"] == {"ok": True, "count": THREADS, "native_ids": THREADS}, out["threads"]
    assert out["executor"] == {"ok": True}, out["executor"]
    assert out["posix_spawn"] == {"ok": True}, out["posix_spawn"]
    assert out["fork"]["ok"], out["fork"]


def test_threads_start_and_process_creation_stays_refused(gateway: Gateway, dockerd: Dockerd) -> None:
    """`sandbox run` in both runtimes: the same answers, threads work, namespaces and tracers do not."""
    got = {runtime: sandbox_run(gateway, dockerd, runtime) for runtime in ("docker", "gvisor")}
    for runtime, out in got.items():
        assert_threads_work(out)
        assert {k: out[k] for k in REFUSED_NOW} == REFUSED_NOW, (runtime, out)
    assert got["docker"] == got["gvisor"], got


def test_controls_without_the_gvisor_variant_and_without_a_profile(dockerd: Dockerd, tmp_path: Path) -> None:
    """The probe can fail: the profile without the gVisor variant (what the gvisor runtime used before)
    stops threads under runsc, and with no profile at all the refused calls succeed."""

    def profile_opt(name: str, profile: dict) -> str:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(profile))
        return f"seccomp={path}"

    runc_profile, gvisor_profile = seccompjson.profile(), seccompjson.profile(runtime="runsc")
    # before the fix: the runc profile under runsc answers clone3 with EPERM, glibc does not fall back
    before = direct_run(dockerd, "runsc", profile_opt("runc", runc_profile))
    assert before["threads"] == {"ok": False, "error": "can't start new thread"}, before
    assert before["executor"] == {"ok": False, "error": "can't start new thread"}, before
    assert before["posix_spawn"] == {"ok": False, "error": "EPERM"}, before
    assert before["clone3"] == {"ok": False, "error": "EPERM"}, before
    # the fix, outside egressgate: the gVisor variant under runsc
    after = direct_run(dockerd, "runsc", profile_opt("gvisor", gvisor_profile))
    assert_threads_work(after)
    assert {k: after[k] for k in REFUSED_NOW} == REFUSED_NOW, after
    # unconfined: the refusals are the profile's, not the kernels'
    for oci_runtime in ("runc", "runsc"):
        free = direct_run(dockerd, oci_runtime, "seccomp=unconfined")
        assert_threads_work(free)
        for name in ("clone_newuser", "unshare_newuser", "ptrace_attach"):
            assert free[name]["ok"], (oci_runtime, name, free[name])
        # runc's kernel implements clone3 (EINVAL for NULL args); runsc 20221219's kernel does not (ENOSYS)
        assert free["clone3"]["error"] == ("EINVAL" if oci_runtime == "runc" else "ENOSYS"), (oci_runtime, free)


def test_gvisor_variant_differs_only_in_the_enosys_rules() -> None:
    """Unit: the gVisor variant is the runc profile with each ENOSYS refusal as SCMP_ACT_TRACE (ENOSYS
    when no tracer exists), nothing else; the runc profile has no TRACE rule; ptrace stays refused."""
    runc, gvisor = seccompjson.profile(), seccompjson.profile(runtime="runsc")
    assert len(runc["syscalls"]) == len(gvisor["syscalls"])
    enosys = {s.name for s in REFUSED if s.errno == errno.ENOSYS}
    assert enosys == {"clone3", "openat2"}
    traced = set()
    for a, b in zip(runc["syscalls"], gvisor["syscalls"], strict=True):
        assert a["action"] == "SCMP_ACT_ERRNO", a
        if a["errnoRet"] == errno.ENOSYS:
            assert b == {k: v for k, v in a.items() if k != "errnoRet"} | {"action": "SCMP_ACT_TRACE"}, b
            traced.update(b["names"])
        else:
            assert a == b
    assert traced == enosys
    assert any(
        "ptrace" in r["names"] and r["action"] == "SCMP_ACT_ERRNO" and "args" not in r for r in gvisor["syscalls"]
    )
    assert {k: v for k, v in gvisor.items() if k != "syscalls"} == {k: v for k, v in runc.items() if k != "syscalls"}
    assert json.loads(seccompjson.security_opt(runtime="runsc")[len("seccomp=") :]) == gvisor
    assert seccompjson.security_opt(runtime=None) == seccompjson.security_opt()
