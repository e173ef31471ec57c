"""Issue 20, what is not an IP packet: from inside each runtime (netns, docker, gVisor) hostile code tries
socket families other than IP (vsock to the hypervisor host, packet, crypto, TIPC, netlink audit and
uevent), the syscalls that walk round a socket filter or the process boundary (io_uring, bpf, userfaultfd,
perf_event_open, keyctl, ptrace, process_vm_readv), and the caller's session keyring. Every attempt is
refused; IP sockets, socketpair, netlink route and getaddrinfo keep working. Positive control: the same
probe on the host (the world's `open` namespace, and uid 65534 in the caller's session for the key)
succeeds, so the refusals are the runtime's doing.

vsock is only ever connected to the LOCAL cid 1, never the hypervisor host (cid 2): nothing here sends a
byte off this machine even if a filter failed.

One `sandbox run` per runtime, started with the caller's session key in place, runs both sandbox probes (the
kernel surface and the keyring; tests/runtimes/batch.py frames each, judged on its own), shared by the two
tests of that runtime (module fixture `inside`).
"""

from __future__ import annotations

import ctypes
import json
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.runtimes.batch import Ran, batch, split
from tests.runtimes.escape_probe import (
    ALLOWED,
    PROBE,
    PY,
    REFUSED_FAMILIES,
    REFUSED_SYSCALLS,
    kernel_checks,
    parse,
    probe_argv,
    run_named,
    syscall_numbers,
)
from tests.runtimes.harness import Gateway, safety_net
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns
RUNTIMES = ["netns", "docker", "gvisor"]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def vsock_port() -> int:
    return 20000 + secrets.randbelow(40000)


def sandbox_run(gateway: Gateway, dockerd: Dockerd | None, runtime: str, *command: str,
                preexec: object = safety_net) -> subprocess.CompletedProcess[str]:
    extra = [] if runtime == "netns" else ["--runtime", runtime, "--image", dockerd.python_image()]  # type: ignore[union-attr]
    argv = gateway.cmd("sandbox", "run", "--config", str(gateway.config), "--policy", "rt-allow", *extra,
                       "--", *command)
    env = gateway.caller_env() if dockerd is None else {**gateway.caller_env(), "DOCKER_HOST": dockerd.host}
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, check=False,
                          preexec_fn=preexec)  # type: ignore[arg-type]


@pytest.fixture
def docker_or_none(request: pytest.FixtureRequest, runtime: str) -> Dockerd | None:
    return None if runtime == "netns" else request.getfixturevalue("dockerd")


@dataclass
class Inside:
    """One runtime's run of both probes: each program's part, the kernel checks, the caller's key."""

    ran: dict[str, Ran]
    checks: dict[str, list]
    description: str
    payload: bytes


@pytest.fixture(scope="module")
def inside(gateway: Gateway) -> Callable[[str, Dockerd | None], Inside]:
    """`inside(runtime, dockerd)`: the runtime's one `sandbox run` of both probes, made on first use."""
    done: dict[str, Inside] = {}

    def get(runtime: str, dockerd: Dockerd | None) -> Inside:
        if runtime not in done:
            done[runtime] = run_both(gateway, dockerd, runtime)
        return done[runtime]

    return get


def run_both(gateway: Gateway, dockerd: Dockerd | None, runtime: str) -> Inside:
    checks = kernel_checks(vsock_port())
    description = f"egN-caller-{secrets.token_hex(4)}"
    payload = f"caller-secret-{secrets.token_hex(8)}".encode()

    def with_key() -> None:
        safety_net()
        add_session_key(description, payload)

    programs = {"kernel": probe_argv(list(checks.values())),
                "keyring": probe_argv([["keyring", syscall_numbers()["keyctl"], description]])}
    res = sandbox_run(gateway, dockerd, runtime, *batch(programs), preexec=with_key)
    assert res.returncode == 0, res.stderr
    return Inside(split(list(programs), res.stdout, res.stderr), checks, description, payload)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_only_ip_families_and_no_sidestep_syscalls(inside: Callable[[str, Dockerd | None], Inside],
                                                   docker_or_none: Dockerd | None, runtime: str) -> None:
    run = inside(runtime, docker_or_none)
    kernel = run.ran["kernel"]
    assert kernel.returncode == 0, kernel
    out = run_named(run.checks, kernel.stdout)
    # vsock: refused at socket(2), before any bind or connect
    assert not out["vsock"]["ok"] and out["vsock"]["step"] == "socket", out["vsock"]
    for name in REFUSED_FAMILIES:
        assert not out[name]["ok"], (name, out[name])
    for name in ALLOWED:
        assert out[name] == {"ok": True}, (name, out[name])
    assert out["resolve"]["ok"] and out["resolve"]["addrs"], out["resolve"]
    assert "lo" in out["resolve"]["ifs"]
    for name in REFUSED_SYSCALLS:
        assert not out[name]["ok"], (name, out[name])
    # the errnos are the filter's. gVisor applies the same profile in its own kernel (the test daemon
    # registers runsc with --oci-seccomp, as docs/runtimes.md asks; without it gVisor allowed its own
    # NETLINK_KOBJECT_UEVENT), but runsc 20221219 answers every refusal with EPERM (errnoRet ignored)
    def errno_of(expected: str) -> tuple[str, ...]:
        return (expected, "EPERM") if runtime == "gvisor" else (expected,)

    for name in ("vsock", "packet", "alg", "tipc"):
        assert out[name]["error"] in errno_of("EAFNOSUPPORT"), (name, out[name])
    for name in ("netlink_audit", "netlink_uevent"):
        assert out[name]["error"] in errno_of("EPROTONOSUPPORT"), (name, out[name])
    for name in REFUSED_SYSCALLS:
        assert out[name]["error"] == "EPERM", (name, out[name])


def test_positive_control_on_the_host(gateway: Gateway) -> None:
    """The same probe outside any sandbox (root in the world's `open` namespace): vsock opens and binds
    (these machines are VMs with a vsock device), the other families open, and every refused syscall
    reaches the kernel (which answers anything but EPERM)."""
    checks = kernel_checks(vsock_port())
    ctl = gateway.world.exec(gateway.world.open, PY, "-c", PROBE, json.dumps(list(checks.values())), timeout=60)
    assert ctl.returncode == 0, ctl.stderr
    out = run_named(checks, ctl.stdout)
    assert out["vsock"]["ok"] or out["vsock"]["step"] == "connect", out["vsock"]  # socket + bind worked
    for name in ("packet", "netlink_audit", "netlink_uevent", *ALLOWED):
        assert out[name] == {"ok": True}, (name, out[name])
    for name in REFUSED_SYSCALLS:
        assert out[name].get("error") != "EPERM", (name, out[name])
    assert out["keyctl"]["ok"] and out["userfaultfd"]["ok"]


# ----------------------------------------------------------------------------- the caller's session keyring
def add_session_key(description: str, payload: bytes) -> int:
    """In the calling process: join a new session keyring (the test's own, shared with nothing) and add a
    `user` key to it. Runs as a preexec function: only prepared ctypes calls."""
    nr = syscall_numbers()
    if _libc.syscall(ctypes.c_long(nr["keyctl"]), ctypes.c_long(1), None) < 0:  # KEYCTL_JOIN_SESSION_KEYRING
        raise OSError(ctypes.get_errno(), "join session keyring")
    key = _libc.syscall(ctypes.c_long(nr["add_key"]), b"user", description.encode(), payload,
                        ctypes.c_long(len(payload)), ctypes.c_long(-3))  # KEY_SPEC_SESSION_KEYRING
    if key < 0:
        raise OSError(ctypes.get_errno(), "add_key")
    return int(key)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_caller_session_key_not_readable_inside(inside: Callable[[str, Dockerd | None], Inside],
                                                docker_or_none: Dockerd | None, runtime: str) -> None:
    run = inside(runtime, docker_or_none)
    description, payload = run.description, run.payload
    keyring = run.ran["keyring"]
    assert keyring.returncode == 0, keyring
    (found,) = parse(keyring.stdout)
    assert not found["ok"] and all(payload.decode() not in p.stdout for p in run.ran.values()), found
    assert not found.get("proc_keys"), found  # not even the description: the keyring is not the caller's

    def with_key() -> None:
        safety_net()
        add_session_key(description, payload)

    probe = [["keyring", syscall_numbers()["keyctl"], description]]
    # positive control: in the same kind of session, a uid-65534 child outside the sandbox reads the key
    ctl = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", PY, "-c", PROBE,
                          json.dumps(probe)], capture_output=True, text=True, timeout=30, check=False,
                         preexec_fn=with_key)
    (outside,) = parse(ctl.stdout)
    assert outside["ok"] and outside["payload"] == payload.decode() and outside["proc_keys"], (outside, ctl.stderr)
