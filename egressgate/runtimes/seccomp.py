"""The netns runtime's seccomp filter: no Unix sockets of the workload's own making.

Why: the netns sandbox sees the host root read-only, and a read-only mount does not stop connect(2) to
a Unix socket on it. Any host socket uid 65534 may open (mode 0666 under traversable directories,
outside the sandbox's tmpfs /tmp and /run) would be a way out that no nftables rule sees: a host
service that proxies, resolves or runs commands. Which sockets exist on a host cannot be known when the
sandbox starts, so the workload may not create AF_UNIX sockets at all (socket(2) → EACCES);
socketpair(2) stays allowed (anonymous, already connected: asyncio, multiprocessing pipes), and
abstract sockets are per network namespace anyway.

Also refused, because they would walk around the filter: io_uring (IORING_OP_SOCKET/CONNECT create and
connect sockets without the socket(2) syscall), x32 system calls, and any other ABI than the native one
(i386 socketcall(2) hides the family behind a pointer seccomp cannot read): ENOSYS/EPERM.

The program is classic BPF as bwrap's `--seccomp FD` wants it (what seccomp_export_bpf writes); bwrap
loads it (with no_new_privs) just before it execs the workload. Stdlib only: `sandbox run` start-up.
"""

from __future__ import annotations

import errno
import platform
import socket
import struct

# BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
X32_SYSCALL_BIT = 0x40000000
# native ABI: (AUDIT_ARCH_*, socket, io_uring_setup, io_uring_enter, io_uring_register)
ARCHES = {
    "x86_64": (0xC000003E, 41, 425, 426, 427),
    "aarch64": (0xC00000B7, 198, 425, 426, 427),
}


class SeccompUnavailable(RuntimeError):
    """No filter for this machine: the run must not start without it (fail closed)."""


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def no_unix_sockets(machine: str | None = None) -> bytes:
    """The compiled filter for `machine` (default: this one)."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise SeccompUnavailable(f"no seccomp filter for the {machine} architecture: the netns runtime "
                                 "cannot keep the workload away from host Unix sockets here")
    arch, nr_socket, *nr_uring = ARCHES[machine]
    prog = [
        _insn(LD_W_ABS, 4),                        # 0  seccomp_data.arch
        _insn(JEQ_K, arch, 0, 11),                 # 1  other ABI → 13 ENOSYS
        _insn(LD_W_ABS, 0),                        # 2  seccomp_data.nr
        _insn(JGE_K, X32_SYSCALL_BIT, 9, 0),       # 3  x32 → 13 ENOSYS
        _insn(JEQ_K, nr_uring[0], 7, 0),           # 4  io_uring_* → 12 EPERM
        _insn(JEQ_K, nr_uring[1], 6, 0),           # 5
        _insn(JEQ_K, nr_uring[2], 5, 0),           # 6
        _insn(JEQ_K, nr_socket, 0, 2),             # 7  not socket(2) → 10 allow
        _insn(LD_W_ABS, 16),                       # 8  args[0] (low 32 bits: the domain, an int)
        _insn(JEQ_K, socket.AF_UNIX, 1, 0),        # 9  AF_UNIX → 11 EACCES
        _insn(RET_K, RET_ALLOW),                   # 10
        _insn(RET_K, RET_ERRNO | errno.EACCES),    # 11
        _insn(RET_K, RET_ERRNO | errno.EPERM),     # 12
        _insn(RET_K, RET_ERRNO | errno.ENOSYS),    # 13
    ]
    return b"".join(prog)
