"""The docker and gVisor runtimes' seccomp profile (Docker's JSON format, HostConfig.SecurityOpt
`seccomp=<json>`), compiled from the same table as the netns runtime's BPF filter (seccomp.py).

Why an explicit profile: the daemon's default profile of Docker 20.10 allows AF_VSOCK (a route to the
hypervisor host that no namespace or nft rule sees), keyctl and io_uring. An explicit profile REPLACES the
default, so this one must also hold what the default held that matters here. Shape, and why:

* defaultAction SCMP_ACT_ALLOW plus the refusals of seccomp.REFUSED — the same rule set as the netns
  filter, not Docker's default allowlist of syscall names. What the default refuses beyond this table is
  gated on a capability (mount, reboot, module loading, clock and quota calls, ...) and the container has
  none (CapDrop ALL, no-new-privileges, never uid 0), except namespace creation: unshare and
  clone(CLONE_NEWUSER) are in the table, and clone3 (whose flags seccomp cannot read) gets ENOSYS so glibc
  falls back to clone. A copy of Docker's list would also tie us to one daemon version's list.
* the socket family allowlist is refusal rules of one comparison each (see _refused_values: "domain >
  AF_NETLINK", then "domain == v" for each v below it that is not allowed). libseccomp compares 64-bit
  values, so a domain with junk in its upper 32 bits (which the kernel truncates to an int) is above
  every allowed value and refused, never allowed by accident. The netlink protocol rules match the
  family on its low 32 bits (SCMP_CMP_MASKED_EQ) for the same reason.
* set-id modes: chmod/open/mknod and their variants (seccomp.SETID_MODE) are refused when the mode
  argument has S_ISUID or S_ISGID, one SCMP_CMP_MASKED_EQ rule per bit and call.
* architectures: the native ones only (x86_64, aarch64): any other ABI (i386 socketcall, x32) gets the
  filter's bad-architecture action (refused).

gVisor (runsc) applies the container's profile inside its own kernel only when the runtime is registered
with `--oci-seccomp` (daemon.json runtimeArgs; docs/runtimes.md). Without it gVisor still refuses vsock,
has its own keyrings and no bpf/userfaultfd/perf_event_open/io_uring (by default).

The gVisor variant (`runtime="runsc"`): runsc's OCI converter ignores `errnoRet` (runsc 20221219, and
upstream as of gVisor issue #14688): every SCMP_ACT_ERRNO answers EPERM. For the ENOSYS rules that is
not cosmetic: glibc >= 2.34 creates every thread (and posix_spawn's child) with clone3 first and falls
back to clone(2) only on ENOSYS, so under EPERM no thread starts at all ("can't start new thread").
So there those rules use SCMP_ACT_TRACE instead: with no ptrace tracer attached the kernel (gVisor's
as Linux's, kernel/seccomp.go: "If there is no tracer present, -ENOSYS is returned to userland and the
system call is not executed") answers ENOSYS whatever errnoRet says. It is as strict as the refusal:
the call never runs unless a tracer that asked for seccomp events (PTRACE_O_TRACESECCOMP) lets it, and
no tracer can exist: inside gVisor only the sandbox's own tasks can ptrace one another, and ptrace(2) is
refused to all of them by this same profile (its EPERM needs no errnoRet); a filter the workload adds
itself cannot loosen it (the least permissive action of all filters wins, TRACE < ALLOW). The docker
(runc) profile keeps SCMP_ACT_ERRNO with errnoRet ENOSYS, which libseccomp honours and which no tracer
can override. The other errnoRet rules (socket families: EAFNOSUPPORT, EPROTONOSUPPORT) have no such
equivalent and stay refusals that answer EPERM under runsc.
"""

from __future__ import annotations

import errno
import json

from egressgate.runtimes import seccomp
from egressgate.runtimes.seccomp import ERR_FAMILY, ERR_PROTOCOL, REFUSED, SOCKET, SOCKETPAIR

ARCHITECTURES = ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"]
LOW32 = 0xFFFFFFFF


GVISOR = "runsc"  # the OCI runtime name whose converter ignores errnoRet (the gvisor adapter's)


def _errno(names: list[str], err: int, args: list[dict] | None = None, *, gvisor: bool = False) -> dict:
    """A refusal answering `err`; under gVisor an ENOSYS refusal is SCMP_ACT_TRACE (the module docstring)."""
    if gvisor and err == errno.ENOSYS:
        rule: dict = {"names": names, "action": "SCMP_ACT_TRACE"}
    else:
        rule = {"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": err}
    if args:
        rule["args"] = args
    return rule


def _eq(index: int, value: int) -> dict:
    return {"index": index, "value": value, "valueTwo": 0, "op": "SCMP_CMP_EQ"}


def _refused_values(allowed: dict[int, object], index: int = 0) -> list[tuple[list[dict], int]]:
    """An allowlist of small integers as refusal conditions of ONE comparison each (libseccomp does not
    AND two comparisons of the same argument within a rule: verified with Docker 20.10, runc and
    libseccomp 2.5.4, where such a rule refused socket(AF_INET)): everything above the largest allowed
    value, then each value below it that is not allowed. The comparisons are 64-bit, so a value with junk
    in its upper 32 bits is above the largest allowed one: refused, whatever int the kernel reads."""
    top = max(allowed)
    out = [([{"index": index, "value": top, "valueTwo": 0, "op": "SCMP_CMP_GT"}], ERR_FAMILY)]
    out += [([_eq(index, v)], ERR_FAMILY) for v in range(top) if v not in allowed]
    return out


def profile(*, unix_sockets: bool = True, runtime: str | None = None) -> dict:
    """The profile as a dict (see the module docstring). Containers see no host socket path (their root
    is the image), so socket(AF_UNIX) is allowed there by default. `runtime` is the container's OCI
    runtime (None: the daemon's default, runc); "runsc" gets the gVisor variant of the ENOSYS rules."""
    gvisor = runtime == GVISOR
    rules: list[dict] = []
    by_errno: dict[int, list[str]] = {}
    for s in REFUSED:
        if s.flags:  # refused only when the first argument has one of these bits
            rules.append(_errno([s.name], s.errno, [{"index": 0, "value": s.flags, "valueTwo": s.flags,
                                                     "op": "SCMP_CMP_MASKED_EQ"}], gvisor=gvisor))
        else:
            by_errno.setdefault(s.errno, []).append(s.name)
    rules += [_errno(names, err, gvisor=gvisor) for err, names in sorted(by_errno.items())]
    for bit in (seccomp.S_ISUID, seccomp.S_ISGID):  # one comparison per rule (see _refused_values)
        for m in seccomp.SETID_MODE:
            rules.append(_errno([m.name], errno.EPERM, [{"index": m.arg, "value": bit, "valueTwo": bit,
                                                         "op": "SCMP_CMP_MASKED_EQ"}]))
    allowed = seccomp.families(unix_sockets)
    for family, err in _refused_values(allowed):
        rules.append(_errno([SOCKET.name], seccomp.ERR_UNIX if family == [_eq(0, seccomp.AF_UNIX)] else err, family))
    for family, protocols in sorted(allowed.items()):
        if protocols is not None:
            match_family = {"index": 0, "value": LOW32, "valueTwo": family, "op": "SCMP_CMP_MASKED_EQ"}
            rules += [_errno([SOCKET.name], ERR_PROTOCOL, [match_family, *proto])
                      for proto, _ in _refused_values(dict.fromkeys(protocols), index=2)]
    rules += [_errno([SOCKETPAIR.name], err, cond)
              for cond, err in _refused_values(dict.fromkeys(seccomp.PAIR_FAMILIES))]
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ARCHITECTURES, "syscalls": rules}


def security_opt(*, unix_sockets: bool = True, runtime: str | None = None) -> str:
    """HostConfig.SecurityOpt entry: `seccomp=` followed by the profile's JSON (what the CLI sends for
    `--security-opt seccomp=FILE`, after reading the file), for the container's OCI `runtime`."""
    return "seccomp=" + json.dumps(profile(unix_sockets=unix_sockets, runtime=runtime), separators=(",", ":"))
