"""Run INSIDE a sandbox (by the image's python3, stdlib only): does the workload get threads, and do the
process-creating system calls the seccomp profile refuses stay refused?

Usage: python3 -c PROBE '{"clone3": 435, ...}' N → one JSON object on stdout.

Each refused call is made with arguments the kernel itself would answer with something else, so the errno
says who answered: clone3(NULL, 0) is EINVAL for Linux (ENOSYS only from the filter, or from a kernel
without clone3), clone/unshare with CLONE_NEWUSER succeed for an unprivileged uid where the kernel allows
user namespaces, ptrace(PTRACE_ATTACH) on the probe's own child succeeds without the filter (a tracer is
what SCMP_ACT_TRACE would consult).
"""

import ctypes
import errno
import hashlib
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
PTRACE_ATTACH = 16
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def work(seed: int) -> str:
    """Real work per thread: a hash chain, checked against the same chain computed sequentially."""
    digest = str(seed).encode()
    for _ in range(2000):
        digest = hashlib.sha256(digest).digest()
    return digest.hex()


def threads(n: int) -> dict:
    results: dict[int, str] = {}
    native: set[int] = set()
    together = threading.Barrier(n)  # all alive at once: n distinct kernel thread ids

    def run(k: int) -> None:
        native.add(threading.get_native_id())
        results[k] = work(k)
        together.wait(timeout=120)

    try:
        pool = [threading.Thread(target=run, args=(k,)) for k in range(n)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    except RuntimeError as exc:  # "can't start new thread"
        return {"ok": False, "error": str(exc)}
    want = {k: work(k) for k in range(n)}
    return {"ok": results == want, "count": len(results), "native_ids": len(native - {threading.get_native_id()})}


def executor(n: int) -> dict:
    try:
        with ThreadPoolExecutor(max_workers=n) as ex:
            got = list(ex.map(work, range(100, 100 + n)))
    except RuntimeError as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": got == [work(k) for k in range(100, 100 + n)]}


def spawn() -> dict:
    """posix_spawn: glibc >= 2.34 creates its child with clone3 first, too."""
    try:
        pid = os.posix_spawn("/bin/true", ["true"], {})
        return {"ok": os.waitpid(pid, 0)[1] == 0}
    except OSError as exc:
        return {"ok": False, "error": errno.errorcode.get(exc.errno, str(exc))}


def raw(nr: int, *args: int) -> dict:
    """A raw system call; a clone that succeeds leaves its child here, which exits at once."""
    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if rc < 0:
        return {"ok": False, "error": errno.errorcode[ctypes.get_errno()]}
    return {"ok": True, "rc": rc}


def clone(nr: int, flags: int) -> dict:
    out = raw(nr, flags | SIGCHLD, 0, 0, 0, 0)
    if out["ok"]:
        if out["rc"] == 0:
            os._exit(0)
        os.waitpid(out.pop("rc"), 0)
    return out


def attach(nr: int) -> dict:
    """ptrace(PTRACE_ATTACH) on our own sleeping child: the only way a tracer could come to exist."""
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    try:
        out = raw(nr, PTRACE_ATTACH, child, 0, 0)
        out.pop("rc", None)
        return out
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def main() -> None:
    nr, n = json.loads(sys.argv[1]), int(sys.argv[2])
    out = {
        "threads": threads(n),
        "executor": executor(n),
        "posix_spawn": spawn(),
        "clone3": raw(nr["clone3"], 0, 0),
        "clone_newuser": clone(nr["clone"], CLONE_NEWUSER),
        "clone_newnet": clone(nr["clone"], CLONE_NEWNET),
        "unshare_newuser": raw(nr["unshare"], CLONE_NEWUSER),
        "ptrace_attach": attach(nr["ptrace"]),
        "fork": clone(nr["clone"], 0),
    }
    print(json.dumps(out))


main()
