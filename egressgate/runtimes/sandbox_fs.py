"""The netns sandbox's file tree, built from an allowlist (issue 20): what exists inside is what this module
lists, nothing of the host root besides.

Why an allowlist and not the host root read-only: a read-only mount still shows every host path — another
sandbox's workspace, the gateway's var dir, /home, /root, /opt, and every host Unix socket (a read-only
mount does not stop connect(2)/sendto(2) to a socket path; a datagram socketpair reaches one). So bwrap
starts from its own empty tmpfs root and gets:

* the runtime's minimal set, read-only: /usr, /bin, /lib*, /sbin (symlinks into /usr, as on merged-/usr
  Debian, are recreated as symlinks; real directories are bound) and the few /etc entries programs need
  (ETC_ENTRIES); /etc/passwd and /etc/group are generated (root and the sandbox user only: the host's
  list of accounts is not the workload's business);
* the workspace (run.py), a private /tmp, /proc of its pid namespace, a minimal /dev, a tmpfs /run;
* the generated CA bundle at the system trust paths (truststore.py), resolv.conf and hosts (netns.py);
* the policy's `filesystem.allow` entries that name host paths, read-only or read-write as written
  (entries naming the workspace path or /tmp are the sandbox's own, always present: policy/filesystem.py).

Every bind bwrap makes is nosuid (and nodev, except --dev-bind, never used here). An allowed host path that
holds a socket, a device or a FIFO (the path itself, or found in a bounded scan of its tree) refuses the
run: that would be a channel to a host service. The root is remounted read-only at the end (netns.py).
"""

from __future__ import annotations

import os
import stat

from egressgate.runtimes import truststore
from egressgate.runtimes.workload import SetupFailed

MINIMAL_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# what libc, the dynamic loader, TLS libraries, Python and the usual tools read in /etc (of /etc/ssl only the
# OpenSSL config: the trust store inside is the sandbox bundle, truststore.py, and /etc/ssl/private stays out)
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "host.conf", "gai.conf",
               "protocols", "services", "ssl/openssl.cnf", "alternatives", "localtime", "timezone",
               "os-release", "debian_version", "mime.types", "magic", "inputrc", "bash.bashrc", "profile",
               "python3", "environment")
# /etc entries named by pattern: Debian's JDKs link $JAVA_HOME/conf into /etc/java-<N>-openjdk (without it no
# JVM tool starts: java.security is missing)
ETC_GLOBS = ("java-*-openjdk",)
SCAN_LIMIT = 100_000  # entries examined per allowed tree; a larger tree is refused (bounded start-up work)
CHANNEL = {stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFIFO: "a FIFO"}


class FsRefused(SetupFailed):
    """A `filesystem.allow` entry that cannot be given to the sandbox; the message is one sentence."""


def passwd(uid: int, gid: int) -> tuple[bytes, bytes]:
    """Generated /etc/passwd and /etc/group: root (owner of the read-only trees) and the sandbox user."""
    name = "nobody" if uid == 65534 else "sandbox"
    group = "nogroup" if gid == 65534 else "sandbox"
    users = f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n{name}:x:{uid}:{gid}::/tmp:/bin/sh\n"
    groups = f"root:x:0:\n{group}:x:{gid}:\n"
    return users.encode(), groups.encode()


def etc_paths() -> list[str]:
    """The /etc entries of the minimal set that the host has a candidate for (ETC_ENTRIES, ETC_GLOBS)."""
    import glob

    return [*(f"/etc/{e}" for e in ETC_ENTRIES), *sorted(p for g in ETC_GLOBS for p in glob.glob(f"/etc/{g}"))]


def minimal_args() -> list[str]:
    """bwrap arguments for the interpreters, libraries and /etc entries (host paths that do not exist are
    skipped; symlinks are recreated, not followed, so /etc/localtime keeps pointing into /usr)."""
    args: list[str] = []
    for path in (*MINIMAL_TREES, *etc_paths()):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def host_allow_entries(policy: dict) -> list[tuple[str, bool]]:
    """(path, writable) for each `filesystem.allow` entry that names a host path: not the workspace path
    or /tmp (the sandbox's own, present anyway; policy/filesystem.py refuses anything below them)."""
    ws_path = (((policy.get("sandbox") or {}).get("workspace")) or {}).get("path")
    own = {"/tmp", os.path.normpath(ws_path) if ws_path else None}  # noqa: S108 - the sandbox's own /tmp
    out = []
    for entry in (policy.get("filesystem") or {}).get("allow") or []:
        path = os.path.normpath(entry["path"])
        if path not in own:
            out.append((path, bool(entry.get("write"))))
    return out


def check_no_channel(path: str, limit: int = SCAN_LIMIT) -> None:
    """FsRefused when `path` is, or its tree holds, a socket, device or FIFO; or when the tree has more than
    `limit` entries (the scan is bounded, so an unscanned rest is refused, not trusted). Symlinks are not
    followed: they resolve inside the sandbox, where only what is listed exists."""
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return  # nothing to give: bwrap's --*-bind-try skips it
    kind = CHANNEL.get(stat.S_IFMT(top.st_mode))
    if kind:
        raise FsRefused(f"filesystem.allow path {path} is {kind}: a sandbox never gets host sockets or devices")
    if not stat.S_ISDIR(top.st_mode):
        return
    seen, stack = 0, [path]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as it:
                entries = list(it)
        except OSError:
            continue  # unreadable for root too (e.g. vanished): nothing the sandbox could reach through it
        for entry in entries:
            seen += 1
            if seen > limit:
                raise FsRefused(f"filesystem.allow path {path} holds more than {limit} entries: too large to "
                                "check for sockets and devices, allow a narrower path")
            try:  # d_type from getdents: no stat(2) for directories, files and symlinks (most entries)
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    continue
                if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                    continue
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            kind = CHANNEL.get(stat.S_IFMT(mode))
            if kind:
                raise FsRefused(f"filesystem.allow path {path} holds {kind} ({entry.path}): a sandbox never "
                                "gets host sockets or devices")
            if stat.S_ISDIR(mode):
                stack.append(entry.path)


def allow_args(policy: dict) -> list[str]:
    """bwrap arguments binding the policy's host paths (after checking each for sockets and devices). The
    source is the resolved host path; the sandbox sees it at the path the policy wrote."""
    args: list[str] = []
    for path, writable in host_allow_entries(policy):
        source = os.path.realpath(path)
        check_no_channel(source)
        args += ["--bind-try" if writable else "--ro-bind-try", source, path]
    return args


def visible_roots(policy: dict, ws_path: str | None) -> list[str]:
    """The trees that exist inside (a `filesystem.deny` path outside all of them is absent anyway, so it
    needs no mask)."""
    roots = [*MINIMAL_TREES, *etc_paths(), "/etc/passwd", "/etc/group", "/proc", "/dev",
             "/tmp", "/run", truststore.HASHED_DIR, *truststore.OTHER_FILES]  # noqa: S108
    roots += [path for path, _ in host_allow_entries(policy)]
    if ws_path:
        roots.append(os.path.normpath(ws_path))
    return roots


def is_visible(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)
