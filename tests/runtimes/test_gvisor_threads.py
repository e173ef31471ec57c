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

Each container runs several programs one after another (`batch`: the thread probe, node, grpcio, each framed
by marker lines with its own exit status and read on its own), so a runtime or a profile costs one container
start, not one per program: one `sandbox run` per runtime and one `docker run` per (OCI runtime, profile),
shared by the tests that read them (module fixtures). The image is the threaded one (Debian python3, grpcio,
node), which has everything each program needs.
"""

from __future__ import annotations

import errno
import json
import platform
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from egressgate.runtimes import seccompjson
from egressgate.runtimes.seccomp import ARCH_INDEX, REFUSED
from tests.runtimes.batch import Ran, batch, split
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
  "for (let i = 0; i < 2000; i++) h = require('crypto').createHash('sha256').update(h).digest('hex');" +
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


def programs() -> dict[str, list[str]]:
    """The programs a container runs, by name: the thread probe (python3, stdlib), node, grpcio."""
    return {
        "probe": ["python3", "-c", PROBE, numbers(), str(THREADS)],
        "node": ["node", "-e", NODE],
        "grpc": ["python3", "-c", GRPC],
    }


def bounded(names: tuple[str, ...]) -> list[str]:
    """The named programs in one batch (tests/runtimes/batch.py), each under `timeout -s KILL 120`: a program
    that hangs once its threads fail is ended (no verdict depends on it)."""
    return batch({name: programs()[name] for name in names}, bound=120)


def sandbox_batch(gateway: Gateway, dockerd: Dockerd, runtime: str, names: tuple[str, ...]) -> dict[str, Ran]:
    """The programs in one `sandbox run --runtime RUNTIME` on the threaded image."""
    cmd = gateway.cmd(
        "sandbox", "run", "--config", str(gateway.config), "--policy", "rt-allow",
        "--runtime", runtime, "--image", dockerd.threaded_image(), "--", *bounded(names),
    )  # fmt: skip
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**gateway.caller_env(), "DOCKER_HOST": dockerd.host},
        preexec_fn=safety_net,
    )
    assert res.returncode == 0, (runtime, res.stdout, res.stderr)
    return split(names, res.stdout, res.stderr)


def docker_batch(dockerd: Dockerd, oci_runtime: str, seccomp: str, names: tuple[str, ...]) -> dict[str, Ran]:
    """The programs in one container as uid 65534 with no capability, under `oci_runtime` and
    `--security-opt seccomp=...`, outside egressgate."""
    res = dockerd.docker(
        "run", "--rm", "--runtime", oci_runtime, "--network", "none", "--user", "65534:65534",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--security-opt", seccomp,
        dockerd.threaded_image(), *bounded(names), check=False, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, (oci_runtime, seccomp, res.stdout, res.stderr)
    return split(names, res.stdout, res.stderr)


@pytest.fixture(scope="module")
def in_sandbox(gateway: Gateway, dockerd: Dockerd) -> dict[str, dict[str, Ran]]:
    """`sandbox run` in both runtimes: the thread probe, node and grpcio, one run per runtime."""
    return {runtime: sandbox_batch(gateway, dockerd, runtime, ("probe", "node", "grpc")) for runtime in RUNTIMES}


PROFILES: dict[str, Callable[[], dict]] = {
    "runc": seccompjson.profile,
    "gvisor": lambda: seccompjson.profile(runtime="runsc"),
}


@pytest.fixture(scope="module")
def direct(dockerd: Dockerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., dict[str, Ran]]]:
    """`direct(oci_runtime, profile, names)`: the programs under the session daemon's `oci_runtime` with the
    runc profile, its gVisor variant or none ("unconfined"), outside egressgate; one container per
    (oci_runtime, profile), run the first time a test asks for it (every program it is asked for)."""
    tmp = tmp_path_factory.mktemp("profiles")
    wanted = {
        ("runsc", "runc"): ("probe", "node", "grpc"),
        ("runsc", "gvisor"): ("probe", "node", "grpc"),
        ("runc", "unconfined"): ("probe",),
        ("runsc", "unconfined"): ("probe",),
    }
    done: dict[tuple[str, str], dict[str, Ran]] = {}

    def run(oci_runtime: str, profile: str) -> dict[str, Ran]:
        key = (oci_runtime, profile)
        if key not in done:
            opt = "seccomp=unconfined"
            if profile != "unconfined":
                path = tmp / f"{profile}.json"
                path.write_text(json.dumps(PROFILES[profile]()))
                opt = f"seccomp={path}"
            done[key] = docker_batch(dockerd, oci_runtime, opt, wanted[key])
        return done[key]

    yield run


def assert_threads_work(out: dict) -> None:
    assert out["threads"] == {"ok": True, "count": THREADS, "native_ids": THREADS}, out["threads"]
    assert out["executor"] == {"ok": True}, out["executor"]
    assert out["posix_spawn"] == {"ok": True}, out["posix_spawn"]
    assert out["fork"]["ok"], out["fork"]


def probe_of(ran: dict[str, Ran]) -> dict:
    assert ran["probe"].returncode == 0, ran["probe"]
    return ran["probe"].json()


def test_threads_start_and_process_creation_stays_refused(in_sandbox: dict[str, dict[str, Ran]]) -> None:
    """`sandbox run` in both runtimes: the same answers, threads work, namespaces and tracers do not."""
    got = {runtime: probe_of(ran) for runtime, ran in in_sandbox.items()}
    for runtime, out in got.items():
        assert_threads_work(out)
        assert {k: out[k] for k in REFUSED_NOW} == REFUSED_NOW, (runtime, out)
    assert got["docker"] == got["gvisor"], got


def test_controls_without_the_gvisor_variant_and_without_a_profile(direct: Callable[..., dict[str, Ran]]) -> None:
    """The probe can fail: the profile without the gVisor variant (what the gvisor runtime used before)
    stops threads under runsc, and with no profile at all the refused calls succeed."""
    # before the fix: the runc profile under runsc answers clone3 with EPERM, glibc does not fall back
    before = probe_of(direct("runsc", "runc"))
    assert before["threads"] == {"ok": False, "error": "can't start new thread"}, before
    assert before["executor"] == {"ok": False, "error": "can't start new thread"}, before
    assert before["posix_spawn"] == {"ok": False, "error": "EPERM"}, before
    assert before["clone3"] == {"ok": False, "error": "EPERM"}, before
    # the fix, outside egressgate: the gVisor variant under runsc
    after = probe_of(direct("runsc", "gvisor"))
    assert_threads_work(after)
    assert {k: after[k] for k in REFUSED_NOW} == REFUSED_NOW, after
    # unconfined: the refusals are the profile's, not the kernels'
    for oci_runtime in ("runc", "runsc"):
        free = probe_of(direct(oci_runtime, "unconfined"))
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


def test_node_and_grpcio_start_their_threads(in_sandbox: dict[str, dict[str, Ran]]) -> None:
    """Runtimes that start threads of their own: node (V8 platform threads, libuv's pool, workers) and
    grpcio (gRPC core's threads, a server's thread pool), in both runtimes."""
    for runtime, ran in in_sandbox.items():
        assert ran["node"].returncode == 0 and ran["node"].json() == {"workers": 4, "pbkdf2": 32}, (runtime, ran)
        assert ran["grpc"].returncode == 0 and ran["grpc"].json() == {"rpc": "UNIMPLEMENTED"}, (runtime, ran)


def test_node_and_grpcio_fail_under_runsc_without_the_variant(direct: Callable[..., dict[str, Ran]]) -> None:
    """Positive control for the test above: under runsc with the runc profile (before the fix) node aborts
    at start-up and grpcio cannot start a thread; with the gVisor variant both work there."""
    before = direct("runsc", "runc")
    node = before["node"]
    assert node.returncode not in (0, 137, None) and '"workers":4' not in node.stdout, node
    assert before["grpc"].json() == {"error": "can't start new thread"}, before["grpc"]
    after = direct("runsc", "gvisor")
    assert after["node"].json() == {"workers": 4, "pbkdf2": 32}, after["node"]
    assert after["grpc"].json() == {"rpc": "UNIMPLEMENTED"}, after["grpc"]
