"""The seccomp table (runtimes/seccomp.py) compiled two ways: the classic BPF program of the netns runtime,
run here by a tiny BPF interpreter for every family and refused syscall on both architectures and loaded
for real into a child process; and the docker/gVisor profile (seccompjson.py), evaluated with libseccomp's
rule semantics (conditions of one rule ANDed, 64-bit comparisons) and checked to refuse exactly what the
BPF program refuses. The syscall numbers are checked against the kernel's own headers."""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from egressgate.runtimes import seccomp, seccompjson
from egressgate.runtimes.seccomp import (
    ARCH_INDEX,
    AUDIT_ARCH,
    REFUSED,
    RET_ALLOW,
    RET_ERRNO,
    SOCKET,
    SOCKETPAIR,
    bpf_program,
)
from tests.support.env import IN_CI

ALLOW = "allow"
MACHINES = sorted(AUDIT_ARCH)
JUNK = 0x1_0000_0000  # upper 32 bits the kernel ignores for an int argument


def run_bpf(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int | str:
    """Classic BPF as the kernel runs a seccomp filter (only the opcodes the compiler emits). Returns
    "allow" or the errno."""
    full = (list(args) + [0] * 6)[:6]
    data = struct.pack("<iIQ6Q", nr, arch, 0, *full)
    insns = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    for _ in range(len(insns)):
        code, jt, jf, k = insns[pc]
        if code == seccomp.LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code in (seccomp.JEQ_K, seccomp.JGE_K, seccomp.JSET_K):
            hit = {seccomp.JEQ_K: acc == k, seccomp.JGE_K: acc >= k, seccomp.JSET_K: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        elif code == seccomp.RET_K:
            if k == RET_ALLOW:
                return ALLOW
            assert k & 0xFFFF0000 == RET_ERRNO
            return k & 0xFFFF
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
    raise AssertionError("program ran off its end")


def expected_socket(domain: int, protocol: int, unix_sockets: bool) -> int | str:
    low = domain & 0xFFFFFFFF
    allowed = seccomp.families(unix_sockets)
    if low == seccomp.AF_UNIX and not unix_sockets:
        return errno.EACCES
    if low not in allowed:
        return errno.EAFNOSUPPORT
    protocols = allowed[low]
    return ALLOW if protocols is None or (protocol & 0xFFFFFFFF) in protocols else errno.EPROTONOSUPPORT


@pytest.mark.parametrize("machine", MACHINES)
def test_bpf_socket_families_by_allowlist(machine: str) -> None:
    i, arch = ARCH_INDEX[machine], AUDIT_ARCH[machine]
    prog = bpf_program(machine)
    for domain in range(0, 64):
        for protocol in (0, 9, 15):
            want = expected_socket(domain, protocol, unix_sockets=False)
            assert run_bpf(prog, SOCKET.nr[i], arch, (domain, 1, protocol)) == want, (domain, protocol)
            # the kernel reads an int: junk in the upper bits changes nothing (BPF reads the low word)
            assert run_bpf(prog, SOCKET.nr[i], arch, (domain | JUNK, 1, protocol)) == want
        pair = ALLOW if domain == seccomp.AF_UNIX else errno.EAFNOSUPPORT
        assert run_bpf(prog, SOCKETPAIR.nr[i], arch, (domain, 1, 0)) == pair
    assert run_bpf(bpf_program(machine, unix_sockets=True), SOCKET.nr[i], arch, (1, 1, 0)) == ALLOW
    assert run_bpf(prog, SOCKET.nr[i], arch, (40, 1, 0)) == errno.EAFNOSUPPORT  # AF_VSOCK


@pytest.mark.parametrize("machine", MACHINES)
def test_bpf_refused_syscalls_and_abis(machine: str) -> None:
    i, arch = ARCH_INDEX[machine], AUDIT_ARCH[machine]
    prog = bpf_program(machine)
    for s in REFUSED:
        if s.flags:
            assert run_bpf(prog, s.nr[i], arch, (s.flags | 0x11,)) == s.errno, s.name
            assert run_bpf(prog, s.nr[i], arch, (0x11,)) == ALLOW, s.name  # fork, threads
        else:
            assert run_bpf(prog, s.nr[i], arch, ()) == s.errno, s.name
    refused = {s.nr[i] for s in REFUSED if not s.flags} | {SOCKET.nr[i], SOCKETPAIR.nr[i]}
    for nr in set(range(0, 460)) - refused - {s.nr[i] for s in REFUSED}:
        assert run_bpf(prog, nr, arch, (0,)) == ALLOW, nr
    assert run_bpf(prog, 0, 0x40000003, ()) == errno.ENOSYS  # i386 (socketcall)
    assert run_bpf(prog, 41 | seccomp.X32_SYSCALL_BIT, arch, ()) == errno.ENOSYS  # x32


def test_syscall_numbers_match_the_kernel_headers() -> None:
    """x86_64 from asm/unistd_64.h, aarch64 from asm-generic/unistd.h (linux-libc-dev)."""
    x86 = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    generic = Path("/usr/include/asm-generic/unistd.h")
    if not (x86.exists() and generic.exists()):
        if IN_CI:
            pytest.fail("linux-libc-dev headers missing in CI: apt-get install linux-libc-dev")
        pytest.skip("outside CI: linux-libc-dev headers not installed, syscall numbers not cross-checked")

    def table(text: str) -> dict[str, int]:
        return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", text)}

    tx, ta = table(x86.read_text()), table(generic.read_text())
    for s in (*REFUSED, SOCKET, SOCKETPAIR):
        assert s.nr == (tx[s.name], ta[s.name]), s.name


# ----------------------------------------------------------------------------- the docker/gVisor profile
def profile_verdict(profile: dict, name: str, args: tuple[int, ...]) -> int | str:
    """libseccomp's semantics as observed (Docker 20.10, runc, libseccomp 2.5.4): a rule matches when all
    its conditions hold, compared as unsigned 64-bit values; the first matching refusal wins."""
    full = (list(args) + [0] * 6)[:6]
    for rule in profile["syscalls"]:
        if name not in rule["names"]:
            continue
        ok = True
        for cond in rule.get("args", []):
            a, v, v2 = full[cond["index"]] & 0xFFFFFFFFFFFFFFFF, cond["value"], cond["valueTwo"]
            ok &= {"SCMP_CMP_EQ": a == v, "SCMP_CMP_NE": a != v, "SCMP_CMP_GT": a > v,
                   "SCMP_CMP_MASKED_EQ": a & v == v2}[cond["op"]]
        if ok:
            return rule["errnoRet"] if rule["action"] == "SCMP_ACT_ERRNO" else ALLOW
    return ALLOW if profile["defaultAction"] == "SCMP_ACT_ALLOW" else -1


def test_profile_matches_the_bpf_program() -> None:
    """One table, two compilers: the same calls are refused (docker allows socket(AF_UNIX): a container
    sees no host socket path)."""
    profile = seccompjson.profile(unix_sockets=True)
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    assert set(profile["architectures"]) == {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"}
    for s in REFUSED:
        args = (s.flags,) if s.flags else ()
        assert profile_verdict(profile, s.name, args) == s.errno, s.name
        if s.flags:
            assert profile_verdict(profile, s.name, (0x11,)) == ALLOW
    assert profile_verdict(profile, "read", ()) == ALLOW
    for domain in range(0, 64):
        for protocol in (0, 9, 15):
            want = expected_socket(domain, protocol, unix_sockets=True)
            assert profile_verdict(profile, "socket", (domain, 1, protocol)) == want, (domain, protocol)
            # junk in the upper bits: refused (64-bit comparisons), never allowed by accident
            assert profile_verdict(profile, "socket", (domain | JUNK, 1, protocol)) != ALLOW
            if domain == seccomp.AF_NETLINK:  # the one family whose protocol is checked
                assert profile_verdict(profile, "socket", (domain, 1, protocol | JUNK)) == errno.EPROTONOSUPPORT
        assert profile_verdict(profile, "socketpair", (domain, 1, 0)) == (
            ALLOW if domain == 1 else errno.EAFNOSUPPORT)
    opt = seccompjson.security_opt()
    assert opt.startswith("seccomp=") and json.loads(opt[len("seccomp="):]) == profile
    # one comparison per argument in a rule: libseccomp does not AND two of the same argument
    for rule in profile["syscalls"]:
        indexes = [c["index"] for c in rule.get("args", [])]
        assert len(indexes) == len(set(indexes)), rule


# ----------------------------------------------------------------------------- the real kernel
LOADER = r"""
import ctypes, errno, json, socket, sys
prog = sys.stdin.buffer.read()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
nr = json.loads(sys.argv[1])
def call(n, *a):
    rc = libc.syscall(ctypes.c_long(n), *[ctypes.c_long(x) for x in a])
    return "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
def sock(*a):
    try:
        socket.socket(*a).close(); return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
def pair():
    a, b = socket.socketpair(); a.close(); b.close(); return "ok"
def checks():
    return {"vsock": sock(40, 1), "packet": sock(17, 2), "inet": sock(2, 1), "inet6": sock(10, 2),
            "route": sock(16, 3, 0), "audit": sock(16, 3, 9), "unix": sock(1, 1), "pair": pair(),
            "bpf": call(nr["bpf"], 9999, 0, 0), "keyctl": call(nr["keyctl"], 0, -3, 0),
            "io_uring_setup": call(nr["io_uring_setup"], 1, 0), "perf": call(nr["perf_event_open"], 0, 0, -1, -1, 0)}
before = checks()
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
fprog = Fprog(len(prog) // 8, prog)
assert libc.syscall(ctypes.c_long(nr["seccomp"]), 1, 0, ctypes.byref(fprog)) == 0, ctypes.get_errno()
print(json.dumps({"before": before, "after": checks()}))
"""


def test_the_filter_in_a_real_process() -> None:
    """Loaded with seccomp(2) into a child (root, so the kernel itself would allow everything): the
    same calls before (positive control) and after."""
    machine = platform.machine()
    if machine not in AUDIT_ARCH:
        pytest.skip(f"no filter for {machine}")  # fail-closed refusal is tested in test_plumbing_units
    i = ARCH_INDEX[machine]
    nr = {s.name: s.nr[i] for s in REFUSED} | {"seccomp": (317, 277)[i]}
    res = subprocess.run([sys.executable, "-c", LOADER, json.dumps(nr)], input=bpf_program(), capture_output=True,
                         timeout=30, check=False, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert res.returncode == 0, res.stderr.decode()
    out = json.loads(res.stdout)
    before, after = out["before"], out["after"]
    assert before["vsock"] == before["packet"] == before["audit"] == before["keyctl"] == "ok", before
    assert before["bpf"] != "EPERM" and before["io_uring_setup"] != "EPERM" and before["perf"] != "EPERM"
    assert after == {"vsock": "EAFNOSUPPORT", "packet": "EAFNOSUPPORT", "inet": "ok", "inet6": "ok",
                     "route": "ok", "audit": "EPROTONOSUPPORT", "unix": "EACCES", "pair": "ok", "bpf": "EPERM",
                     "keyctl": "EPERM", "io_uring_setup": "EPERM", "perf": "EPERM"}, after


def test_every_refused_syscall_is_documented() -> None:
    """docs/runtimes.md says why each entry is there: a new entry without a line there fails here."""
    doc = (Path(__file__).parents[2] / "docs" / "runtimes.md").read_text()
    for s in REFUSED:
        assert f"`{s.name}`" in doc, s.name


@pytest.mark.parametrize("machine", MACHINES)
def test_setid_modes_are_refused_by_both_compilers(machine: str) -> None:
    """chmod/open/mknod and variants with S_ISUID or S_ISGID in the mode argument: EPERM (BPF on both
    architectures, and the docker profile); the same calls with ordinary modes are allowed."""
    i, arch = ARCH_INDEX[machine], AUDIT_ARCH[machine]
    prog = bpf_program(machine)
    profile = seccompjson.profile(unix_sockets=True)
    for m in seccomp.SETID_MODE:
        for mode, want in ((0o4755, errno.EPERM), (0o2755, errno.EPERM), (0o6000, errno.EPERM),
                           (0o755, ALLOW), (0o1777, ALLOW), (0, ALLOW)):
            args = tuple(mode if n == m.arg else 0 for n in range(m.arg + 1))
            if m.nr[i] != seccomp.NO_NR:
                assert run_bpf(prog, m.nr[i], arch, args) == want, (m.name, oct(mode))
            assert profile_verdict(profile, m.name, args) == want, (m.name, oct(mode))
        # set-id bits in ANOTHER argument (flags, fd) do not matter
        other = tuple(0o6000 if n != m.arg else 0o644 for n in range(m.arg + 1))
        if m.nr[i] != seccomp.NO_NR:
            assert run_bpf(prog, m.nr[i], arch, other) == ALLOW, m.name
    openat2 = next(s for s in REFUSED if s.name == "openat2")
    assert run_bpf(prog, openat2.nr[i], arch, ()) == errno.ENOSYS
