"""What a sandboxed workload may not ask the kernel for: ONE table, compiled to the netns runtime's classic
BPF filter (here) and to the docker/gVisor runtimes' seccomp profile (seccompjson.py).

Why a syscall filter at all: a network namespace and nftables see IP packets only. Socket families that
carry no IP (AF_VSOCK reaches the hypervisor host on a VM, AF_PACKET, AF_ALG, netlink families that talk
to the host kernel, ...) and syscalls that walk round the socket filter (io_uring creates and connects
sockets without socket(2)) or round the process boundary (ptrace, process_vm_*, keyrings, bpf, ...) are
routes the gateway never sees. docs/runtimes.md lists every entry and why it is there.

Socket families are an ALLOWLIST: socket(2) only for AF_INET, AF_INET6 and AF_NETLINK with NETLINK_ROUTE
(what glibc's getaddrinfo(AI_ADDRCONFIG)/getifaddrs/if_nameindex open), and AF_UNIX where the runtime
allows it; socketpair(2) only for AF_UNIX. The netns runtime refuses socket(AF_UNIX) (EACCES): its
tree holds no host socket at start (sandbox_fs.py), but a host service may create one later in an allowed
host tree, and a read-only mount does not stop connect(2) to a host socket.

Syscalls are refused by name from REFUSED: the rest stays allowed because every runtime already drops
every capability (and bwrap adds --disable-userns; the docker profile refuses CLONE_NEWUSER), so what the
kernel gates on a capability is refused by the kernel. Calls that set a file mode (SETID_MODE) are refused
when the mode has S_ISUID or S_ISGID (BPF_JSET on that argument): no set-id file is made inside a workspace
that outlives the run. x32 system calls and any ABI other than the
native one are refused (i386 socketcall(2) hides the family behind a pointer seccomp cannot read).

The BPF program is what bwrap's `--seccomp FD` wants (what seccomp_export_bpf writes); bwrap loads it (with
no_new_privs) just before it execs the workload. Stdlib only and built once per run in well under a
millisecond: `sandbox run` start-up.
"""

from __future__ import annotations

import errno
import platform
import struct
from typing import NamedTuple

# BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
X32_SYSCALL_BIT = 0x40000000
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
ARCH_INDEX = {"x86_64": 0, "aarch64": 1}  # position in Syscall.nr
# seccomp_data: nr @0, arch @4, instruction_pointer @8, args[6] @16 (8 bytes each; the low 32 bits first on
# these little-endian machines: socket(2)'s int arguments are those bits, the kernel ignores the rest)
OFF_NR, OFF_ARCH, OFF_ARGS = 0, 4, 16

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
NETLINK_ROUTE = 0
CLONE_NEWUSER = 0x10000000


class Syscall(NamedTuple):
    """One refused system call: its numbers (x86_64, aarch64; checked against the kernel's unistd_64.h and
    asm-generic/unistd.h), the errno the workload gets, and why it is refused (docs/runtimes.md). With
    `flags`, only calls whose first argument has one of those bits set are refused. A NamedTuple, not a
    dataclass: importing dataclasses costs `sandbox run` ~40 ms of start-up (runtimes/base.py)."""

    name: str
    nr: tuple[int, int]
    errno: int
    why: str
    flags: int = 0


_SIDESTEP = "performs socket operations without socket(2): a way round the family allowlist"
_PROCESS = "reads or changes another process or the kernel: refused outright (the pid namespace holds only " \
           "the sandbox's own processes, which need no debugger; ptrace-based tools do not work inside)"
_KEYS = "the kernel keyrings are not namespaced by netns or mount namespaces: a key of the caller or of " \
        "another sandbox of the same uid (the user keyring) must not be reachable"
_KERNEL = "changes the kernel or the mount table: refused by the kernel without capabilities already; " \
          "refused here too, so the rule does not depend on capability handling alone"

REFUSED: tuple[Syscall, ...] = (
    Syscall("io_uring_setup", (425, 425), errno.EPERM, _SIDESTEP),
    Syscall("io_uring_enter", (426, 426), errno.EPERM, _SIDESTEP),
    Syscall("io_uring_register", (427, 427), errno.EPERM, _SIDESTEP),
    Syscall("bpf", (321, 280), errno.EPERM, "eBPF programs and maps (socket filters, sockmap redirection) "
            "are kernel attack surface and can move socket data outside the filter's view"),
    Syscall("userfaultfd", (323, 282), errno.EPERM, "stalls the kernel mid-copy at will: the standard "
            "primitive to win kernel races (exploit surface), no workload needs it"),
    Syscall("perf_event_open", (298, 241), errno.EPERM, "kernel and CPU performance counters: side "
            "channels and a long history of kernel bugs"),
    Syscall("keyctl", (250, 219), errno.EPERM, _KEYS),
    Syscall("add_key", (248, 217), errno.EPERM, _KEYS),
    Syscall("request_key", (249, 218), errno.EPERM, _KEYS + "; request_key can also start a host upcall"),
    Syscall("ptrace", (101, 117), errno.EPERM, _PROCESS),
    Syscall("process_vm_readv", (310, 270), errno.EPERM, _PROCESS),
    Syscall("process_vm_writev", (311, 271), errno.EPERM, _PROCESS),
    Syscall("pidfd_getfd", (438, 438), errno.EPERM, _PROCESS + "; it copies another process's descriptors"),
    Syscall("kexec_load", (246, 104), errno.EPERM, _KERNEL),
    Syscall("kexec_file_load", (320, 294), errno.EPERM, _KERNEL),
    Syscall("init_module", (175, 105), errno.EPERM, _KERNEL),
    Syscall("finit_module", (313, 273), errno.EPERM, _KERNEL),
    Syscall("delete_module", (176, 106), errno.EPERM, _KERNEL),
    Syscall("open_by_handle_at", (304, 265), errno.EPERM, "opens a file by handle, bypassing the path "
            "walk and so every mount and mask of the sandbox (the 'shocker' container escape)"),
    Syscall("mount", (165, 40), errno.EPERM, _KERNEL),
    Syscall("umount2", (166, 39), errno.EPERM, _KERNEL + "; unmounting a mask would reveal the host file"),
    Syscall("pivot_root", (155, 41), errno.EPERM, _KERNEL),
    Syscall("open_tree", (428, 428), errno.EPERM, _KERNEL),
    Syscall("move_mount", (429, 429), errno.EPERM, _KERNEL),
    Syscall("fsopen", (430, 430), errno.EPERM, _KERNEL),
    Syscall("fsconfig", (431, 431), errno.EPERM, _KERNEL),
    Syscall("fsmount", (432, 432), errno.EPERM, _KERNEL),
    Syscall("fspick", (433, 433), errno.EPERM, _KERNEL),
    Syscall("mount_setattr", (442, 442), errno.EPERM, _KERNEL),
    Syscall("swapon", (167, 224), errno.EPERM, _KERNEL),
    Syscall("swapoff", (168, 225), errno.EPERM, _KERNEL),
    Syscall("reboot", (169, 142), errno.EPERM, _KERNEL),
    Syscall("acct", (163, 89), errno.EPERM, _KERNEL),
    Syscall("syslog", (103, 116), errno.EPERM, "the kernel log shows host activity (and addresses that "
            "defeat KASLR) where dmesg_restrict is off"),
    Syscall("fanotify_init", (300, 262), errno.EPERM, "watches file access of whole mounts (unprivileged "
            "since Linux 5.13): other processes' activity on the shared host tree"),
    Syscall("unshare", (272, 97), errno.EPERM, "new namespaces: an unprivileged user namespace gives "
            "capabilities inside it (new network namespaces, mounts) and a large kernel attack surface"),
    Syscall("setns", (308, 268), errno.EPERM, "joining another namespace (another sandbox's, the host's "
            "through an inherited descriptor)"),
    Syscall("clone", (56, 220), errno.EPERM, "clone(CLONE_NEWUSER) is unshare by another name; clone "
            "without namespace flags (fork, threads) stays allowed", flags=CLONE_NEWUSER),
    Syscall("clone3", (435, 435), errno.ENOSYS, "its flags are in memory seccomp cannot read, so clone3 "
            "could create a user namespace: ENOSYS makes glibc fall back to clone(2), which is checked"),
    Syscall("openat2", (437, 437), errno.ENOSYS, "its mode is in memory seccomp cannot read, so openat2 could "
            "create a set-id file (SETID_MODE): ENOSYS makes callers fall back to openat(2), which is checked"),
)

S_ISUID, S_ISGID = 0o4000, 0o2000
NO_NR = -1  # the call does not exist on that architecture (aarch64 has only the *at variants)


class ModeCheck(NamedTuple):
    """A call that sets a file mode: refused (EPERM) when the mode argument (`arg`, 0-based) has S_ISUID or
    S_ISGID. Why: the workspace is a host directory that outlives the run; a set-id file planted there
    would run with the sandbox's identity for any local user after the run (issue 20, item 5). The mount
    is nosuid inside, but not where a host user finds it later. run.py strips whatever still gets through
    (a set-id bit set from outside) at teardown, and audits it."""

    name: str
    nr: tuple[int, int]
    arg: int


SETID_MODE: tuple[ModeCheck, ...] = (
    ModeCheck("chmod", (90, NO_NR), 1),
    ModeCheck("fchmod", (91, 52), 1),
    ModeCheck("fchmodat", (268, 53), 2),
    ModeCheck("fchmodat2", (452, 452), 2),
    ModeCheck("open", (2, NO_NR), 2),  # mode matters with O_CREAT/O_TMPFILE; glibc passes 0 otherwise
    ModeCheck("openat", (257, 56), 3),
    ModeCheck("creat", (85, NO_NR), 1),
    ModeCheck("mknod", (133, NO_NR), 1),
    ModeCheck("mknodat", (259, 33), 2),
)
SETID_BITS = S_ISUID | S_ISGID

SOCKET = Syscall("socket", (41, 198), errno.EAFNOSUPPORT, "families by allowlist")
SOCKETPAIR = Syscall("socketpair", (53, 199), errno.EAFNOSUPPORT, "AF_UNIX only")

# family → allowed protocols (None: any). AF_UNIX is added per runtime (unix_sockets=True).
FAMILIES: dict[int, tuple[int, ...] | None] = {AF_INET: None, AF_INET6: None, AF_NETLINK: (NETLINK_ROUTE,)}
PAIR_FAMILIES = (AF_UNIX,)
ERR_FAMILY = errno.EAFNOSUPPORT  # what a program expects of a family the kernel lacks: it falls back
ERR_PROTOCOL = errno.EPROTONOSUPPORT  # a netlink protocol other than NETLINK_ROUTE
ERR_UNIX = errno.EACCES  # socket(AF_UNIX) where host socket paths are visible (netns)


class SeccompUnavailable(RuntimeError):
    """No filter for this machine: the run must not start without it (fail closed)."""


def families(unix_sockets: bool) -> dict[int, tuple[int, ...] | None]:
    """The socket(2) allowlist of a runtime: FAMILIES, plus AF_UNIX where no host socket path is visible."""
    return {**FAMILIES, AF_UNIX: None} if unix_sockets else dict(FAMILIES)


class _Asm:
    """A tiny classic-BPF assembler: jumps name labels, resolved to forward offsets (0-255) at the end."""

    def __init__(self) -> None:
        self.insns: list[tuple[int, int, int | str, int | str]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        self.insns.append((code, k, jt, jf))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.insns)

    def ret(self, value: int) -> None:
        self.op(RET_K, value)

    def assemble(self) -> bytes:
        out = []
        for pc, (code, k, jt, jf) in enumerate(self.insns):
            offs = [self.labels[j] - pc - 1 if isinstance(j, str) else j for j in (jt, jf)]
            if not all(0 <= o <= 255 for o in offs):
                raise AssertionError(f"BPF jump out of range at {pc}: {offs}")
            out.append(struct.pack("=HBBI", code, offs[0], offs[1], k))
        return b"".join(out)


def bpf_program(machine: str | None = None, *, unix_sockets: bool = False) -> bytes:
    """The compiled filter for `machine` (default: this one). Every refused call returns its errno; socket(2)
    and socketpair(2) are checked against the family allowlist on the low 32 bits of their arguments
    (the int the kernel reads)."""
    machine = machine or platform.machine()
    if machine not in AUDIT_ARCH:
        raise SeccompUnavailable(f"no seccomp filter for the {machine} architecture: the runtime cannot keep "
                                 "the workload away from vsock, host Unix sockets and io_uring here")
    i = ARCH_INDEX[machine]
    a = _Asm()
    a.op(LD_W_ABS, OFF_ARCH)
    a.op(JEQ_K, AUDIT_ARCH[machine], 0, "enosys")  # another ABI (i386, and its socketcall)
    a.op(LD_W_ABS, OFF_NR)
    a.op(JGE_K, X32_SYSCALL_BIT, "enosys", 0)
    a.op(JEQ_K, SOCKET.nr[i], "socket", 0)
    a.op(JEQ_K, SOCKETPAIR.nr[i], "socketpair", 0)
    errnos = sorted({s.errno for s in REFUSED} | {errno.EPERM})
    for s in REFUSED:
        a.op(JEQ_K, s.nr[i], f"flags-{s.name}" if s.flags else f"errno-{s.errno}", 0)
    modes = [m for m in SETID_MODE if m.nr[i] != NO_NR]
    for m in modes:
        a.op(JEQ_K, m.nr[i], f"mode-{m.name}", 0)
    a.ret(RET_ALLOW)
    for m in modes:
        a.label(f"mode-{m.name}")
        a.op(LD_W_ABS, OFF_ARGS + 8 * m.arg)
        a.op(JSET_K, SETID_BITS, f"errno-{errno.EPERM}", "allow")
    for s in REFUSED:
        if s.flags:
            a.label(f"flags-{s.name}")
            a.op(LD_W_ABS, OFF_ARGS)
            a.op(JSET_K, s.flags, f"errno-{s.errno}", "allow")
    a.label("socket")
    a.op(LD_W_ABS, OFF_ARGS)  # domain
    allowed = families(unix_sockets)
    if not unix_sockets:
        a.op(JEQ_K, AF_UNIX, "eunix", 0)
    for family, protocols in allowed.items():
        a.op(JEQ_K, family, "allow" if protocols is None else f"proto-{family}", 0)
    a.ret(RET_ERRNO | ERR_FAMILY)
    for family, protocols in allowed.items():
        if protocols is not None:
            a.label(f"proto-{family}")
            a.op(LD_W_ABS, OFF_ARGS + 16)  # protocol
            for proto in protocols:
                a.op(JEQ_K, proto, "allow", 0)
            a.ret(RET_ERRNO | ERR_PROTOCOL)
    a.label("socketpair")
    a.op(LD_W_ABS, OFF_ARGS)
    for family in PAIR_FAMILIES:
        a.op(JEQ_K, family, "allow", 0)
    a.ret(RET_ERRNO | ERR_FAMILY)
    a.label("eunix")
    a.ret(RET_ERRNO | ERR_UNIX)
    for e in errnos:
        a.label(f"errno-{e}")
        a.ret(RET_ERRNO | e)
    a.label("enosys")
    a.ret(RET_ERRNO | errno.ENOSYS)
    a.label("allow")
    a.ret(RET_ALLOW)
    return a.assemble()


def no_unix_sockets(machine: str | None = None) -> bytes:
    """The netns runtime's filter (kept under its old name): the table above, socket(AF_UNIX) refused."""
    return bpf_program(machine, unix_sockets=False)
