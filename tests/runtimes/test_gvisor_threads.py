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
from subprocess import CompletedProcess

import pytest

from egressgate.runtimes import seccompjson
from egressgate.runtimes.seccomp import ARCH_INDEX, REFUSED
from tests.runtimes.harness import Gateway, safety_net
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns
PROBE = Path(__file__).with_name("thread_probe.py").read_text()
THREADS = 8
RUNTIMES = ("docker", "gvisor")
# node: worker_threads (one OS thread each) and crypto.pbkdf2 on libuv's thread pool; both answers, one line
NODE = """
const { Worker } = require("worker_threads");
const out = {};
const done = () => { if ("workers" in out && "pbkdf2" in out) console.log(JSON.stringify(out)); };
const N = 4;
let n = 0;
const body = "const {parentPort} = require('worker_threads'); let h = 'x';" +
  "for (let i = 0; i < 20000; i++) h = require('crypto').createHash('sha256').update(h).digest('hex');" +
  "parentPort.postMessage(h)";
for (let i = 0; i < N; i++) {
  const w = new Worker(body, { eval: true });
  w.on("message", () => { if (++n === N) { out.workers = n; done(); } });
  w.on("error", (e) => { out.workers = String(e); done(); });
}
require("crypto").pbkdf2("p", "s", 1000, 32, "sha256", (e, k) => { out.pbkdf2 = e ? String(e) : k.length; done(); });
"""
# grpcio: a server on a thread pool and a channel (gRPC core's own threads), one call on loopback; the
# server has no handler, so a completed round trip answers UNIMPLEMENTED
GRPC = """
import json, os
try:
    import grpc
    from concurrent import futures
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)])
    try:
        channel.unary_unary("/egressgate.Probe/Call")(b"hi", timeout=60, wait_for_ready=True)
        out = {"rpc": "OK"}
    except grpc.RpcError as exc:
        out = {"rpc": exc.code().name}
    server.stop(0)
except Exception as exc:
    out = {"error": str(exc)}
print(json.dumps(out), flush=True)
os._exit(0)
"""
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


def sandbox_run(gateway: Gateway, dockerd: Dockerd, runtime: str, image: str, argv: list[str]) -> dict:
    cmd = gateway.cmd(
        "sandbox", "run", "--config", str(gateway.config), "--policy", "rt-allow",
        "--runtime", runtime, "--image", image, "--", *argv,
    )  # fmt: skip
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**gateway.caller_env(), "DOCKER_HOST": dockerd.host},
        preexec_fn=safety_net,
    )
    assert res.returncode == 0, (runtime, argv[0], res.stdout, res.stderr)
    return parse(res.stdout)


def docker_run(dockerd: Dockerd, oci_runtime: str, seccomp: str, image: str, argv: list[str]) -> CompletedProcess[str]:
    """`argv` as uid 65534 with no capability, under `oci_runtime` and `--security-opt seccomp=...`; a
    program that hangs once its threads fail is ended by `timeout` (no verdict depends on it)."""
    return dockerd.docker(
        "run", "--rm", "--runtime", oci_runtime, "--network", "none", "--user", "65534:65534",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--security-opt", seccomp,
        image, "timeout", "-s", "KILL", "120", *argv, check=False, timeout=300,
    )  # fmt: skip


def direct_run(dockerd: Dockerd, oci_runtime: str, seccomp: str) -> dict:
    """The thread probe under `oci_runtime` with `seccomp`, outside egressgate."""
    res = docker_run(dockerd, oci_runtime, seccomp, dockerd.python_image(), probe_argv())
    assert res.returncode == 0, (oci_runtime, seccomp, res.stdout, res.stderr)
    return parse(res.stdout)


def assert_threads_work(out: dict) -> None:
    assert out["threads"] == {"ok": True, "count": THREADS, "native_ids": THREADS}, out["threads"]
    assert out["executor"] == {"ok": True}, out["executor"]
    assert out["posix_spawn"] == {"ok": True}, out["posix_spawn"]
    assert out["fork"]["ok"], out["fork"]


def test_threads_start_and_process_creation_stays_refused(gateway: Gateway, dockerd: Dockerd) -> None:
    """`sandbox run` in both runtimes: the same answers, threads work, namespaces and tracers do not."""
    image = dockerd.python_image()
    got = {runtime: sandbox_run(gateway, dockerd, runtime, image, probe_argv()) for runtime in RUNTIMES}
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


def test_node_and_grpcio_start_their_threads(gateway: Gateway, dockerd: Dockerd) -> None:
    """Runtimes that start threads of their own: node (V8 platform threads, libuv's pool, workers) and
    grpcio (gRPC core's threads, a server's thread pool), in both runtimes."""
    image = dockerd.threaded_image()
    for runtime in RUNTIMES:
        assert sandbox_run(gateway, dockerd, runtime, image, ["node", "-e", NODE]) == {"workers": 4, "pbkdf2": 32}
        assert sandbox_run(gateway, dockerd, runtime, image, ["python3", "-c", GRPC]) == {"rpc": "UNIMPLEMENTED"}


def test_node_and_grpcio_fail_under_runsc_without_the_variant(dockerd: Dockerd, tmp_path: Path) -> None:
    """Positive control for the test above: under runsc with the runc profile (before the fix) node aborts
    at start-up and grpcio cannot start a thread; with the gVisor variant both work there."""
    image = dockerd.threaded_image()
    runc_opt, gvisor_opt = tmp_path / "runc.json", tmp_path / "gvisor.json"
    runc_opt.write_text(json.dumps(seccompjson.profile()))
    gvisor_opt.write_text(json.dumps(seccompjson.profile(runtime="runsc")))
    node = docker_run(dockerd, "runsc", f"seccomp={runc_opt}", image, ["node", "-e", NODE])
    assert node.returncode not in (0, 137) and '"workers":4' not in node.stdout, (node.returncode, node.stderr)
    grpc = docker_run(dockerd, "runsc", f"seccomp={runc_opt}", image, ["python3", "-c", GRPC])
    assert parse(grpc.stdout) == {"error": "can't start new thread"}, (grpc.stdout, grpc.stderr)
    node = docker_run(dockerd, "runsc", f"seccomp={gvisor_opt}", image, ["node", "-e", NODE])
    assert parse(node.stdout) == {"workers": 4, "pbkdf2": 32}, node.stderr
    grpc = docker_run(dockerd, "runsc", f"seccomp={gvisor_opt}", image, ["python3", "-c", GRPC])
    assert parse(grpc.stdout) == {"rpc": "UNIMPLEMENTED"}, grpc.stderr
