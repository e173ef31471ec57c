"""Escape attempts run INSIDE a sandbox (by the system python3, stdlib only; no proxy is used: the
probe ignores HTTP_PROXY exactly as hostile code would). Each check returns what happened; the test
decides, together with the canaries' logs, whether anything got out.

Usage: python3 probe.py '[["tcp", "169.254.169.254", 80], ...]' → one JSON list of results on stdout.
"""

import contextlib
import errno
import json
import os
import socket
import ssl
import struct
import sys

TIMEOUT = 3.0


def err(exc):
    code = getattr(exc, "errno", None)
    return {"ok": False, "error": errno.errorcode.get(code, type(exc).__name__) if code else type(exc).__name__}


def tcp(host, port, payload=""):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT)
            sock.connect((host, port))
            data = b""
            if payload:
                sock.sendall(payload.encode())
                with contextlib.suppress(OSError):
                    data = sock.recv(4096)
            return {"ok": True, "data": data.decode("latin-1")[:300]}
    except OSError as exc:
        return err(exc)


def udp(host, port):
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(1.0)
            sock.sendto(b"\x00" * 32, (host, port))
            try:
                data, peer = sock.recvfrom(4096)
                return {"ok": True, "reply_from": list(peer), "data": data.hex()[:80]}
            except OSError:
                return {"ok": True, "reply_from": None}
    except OSError as exc:
        return err(exc)


def dns_query(name, qid=0x4547):
    header = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00"
    return header + qname + struct.pack("!HH", 1, 1)


def dns(server, name, transport="udp"):
    query = dns_query(name)
    try:
        if transport == "udp":
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.settimeout(TIMEOUT)
                sock.sendto(query, (server, 53))
                data, peer = sock.recvfrom(4096)
        else:
            with socket.create_connection((server, 53), timeout=TIMEOUT) as sock:
                sock.sendall(struct.pack("!H", len(query)) + query)
                data = sock.recv(4096)[2:]
                peer = (server, 53)
        flags, ancount = struct.unpack("!H", data[2:4])[0], struct.unpack("!H", data[6:8])[0]
        return {"ok": True, "rcode": flags & 0xF, "answers": ancount, "reply_from": list(peer)}
    except OSError as exc:
        return err(exc)


def tls(host, port, sni):
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT) as raw, \
                ctx.wrap_socket(raw, server_hostname=sni) as sock:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n".encode())
            return {"ok": True, "data": sock.recv(4096).decode("latin-1")[:300]}
    except (OSError, ssl.SSLError) as exc:
        return err(exc)


def raw_socket(proto):
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, proto).close()
        return {"ok": True}
    except OSError as exc:
        return err(exc)


def icmp_dgram(host):
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP) as sock:
            sock.settimeout(1.0)
            sock.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, 1) + b"egN", (host, 0))
            sock.recvfrom(1024)
            return {"ok": True, "reply": True}
    except OSError as exc:
        return err(exc)


def open_file(path, mode):
    try:
        with open(path, mode) as fh:
            if "r" in mode:
                fh.read(1)
            else:
                fh.write("198.18.0.53 api.allowed.test\n")
        return {"ok": True}
    except OSError as exc:
        return err(exc)


def unix(path):
    """Connect to a Unix socket on the host file system and send a line."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT)
            sock.connect(path)
            sock.sendall(b"egV leak\n")
            return {"ok": True}
    except OSError as exc:
        return err(exc)


def pair():
    """socketpair(2): anonymous, already connected (what asyncio and multiprocessing use)."""
    try:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(b"x")
            return {"ok": b.recv(1) == b"x"}
    except OSError as exc:
        return err(exc)


def family(domain, kind, proto=0):
    """socket(domain, kind, proto): may this family be opened at all?"""
    try:
        socket.socket(domain, kind, proto).close()
        return {"ok": True}
    except OSError as exc:
        return err(exc)


def pair_family(domain, kind):
    try:
        a, b = socket.socketpair(domain, kind)
        a.close()
        b.close()
        return {"ok": True}
    except OSError as exc:
        return err(exc)


def vsock(port):
    """AF_VSOCK socket, bind (any CID), connect to the LOCAL cid 1 (never the hypervisor host, cid 2): the
    step that fails first is reported."""
    step = "socket"
    try:
        with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as sock:
            step = "bind"
            sock.bind((socket.VMADDR_CID_ANY, port))
            step = "connect"
            with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as other:
                other.settimeout(2)
                other.connect((1, port))
            return {"ok": True}
    except OSError as exc:
        return {**err(exc), "step": step}


def resolve(name):
    """glibc's getaddrinfo with AI_ADDRCONFIG (netlink NETLINK_ROUTE), and if_nameindex (netlink too)."""
    try:
        infos = socket.getaddrinfo(name, 443, 0, socket.SOCK_STREAM, 0, socket.AI_ADDRCONFIG)
        return {"ok": True, "addrs": sorted({i[4][0] for i in infos}), "ifs": [n for _, n in socket.if_nameindex()]}
    except OSError as exc:
        return err(exc)


def syscall(nr, *args):
    """A raw system call with integer arguments: its result, or the errno."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if rc < 0:
        code = ctypes.get_errno()
        return {"ok": False, "error": errno.errorcode.get(code, str(code))}
    return {"ok": True, "rc": rc}


def keyring(nr_keyctl, description):
    """Can this process find and read a `user` key by description in its keyrings (keyctl KEYCTL_SEARCH
    from the session keyring, then KEYCTL_READ), and does /proc/keys show it?"""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out = {"ok": False}
    try:
        with open("/proc/keys") as fh:
            out["proc_keys"] = description in fh.read()
    except OSError as exc:
        out["proc_keys_error"] = err(exc)["error"]
    key = libc.syscall(ctypes.c_long(nr_keyctl), ctypes.c_long(10), ctypes.c_long(-3), b"user",
                       description.encode(), ctypes.c_long(0))  # KEYCTL_SEARCH in KEY_SPEC_SESSION_KEYRING
    if key < 0:
        out["error"] = errno.errorcode.get(ctypes.get_errno(), "?")
        return out
    buf = ctypes.create_string_buffer(256)
    n = libc.syscall(ctypes.c_long(nr_keyctl), ctypes.c_long(11), ctypes.c_long(key), buf, ctypes.c_long(256))
    if n < 0:
        out["error"] = errno.errorcode.get(ctypes.get_errno(), "?")
        return out
    return {**out, "ok": True, "payload": buf.raw[:n].decode(errors="replace")}


def dgram(path, how="sendto"):
    """socketpair(AF_UNIX, SOCK_DGRAM) (allowed: no socket(AF_UNIX) needed), then sendto()/connect() to a
    datagram socket PATH: a way to a host service wherever such a path is visible."""
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        with a, b:
            if how == "connect":
                a.connect(path)
                a.send(b"egX leak")
            else:
                a.sendto(b"egX leak", path)
            return {"ok": True}
    except OSError as exc:
        return err(exc)


def chmod(path, mode, create=False):
    """Make `path` (created with that mode when `create`) carry `mode` (e.g. 0o4755: setuid)."""
    try:
        if create:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, mode))
            return {"ok": bool(os.stat(path).st_mode & mode & 0o6000), "mode": oct(os.stat(path).st_mode)}
        os.chmod(path, mode)
        return {"ok": True}
    except OSError as exc:
        return err(exc)


def main():
    out = []
    for check in json.loads(sys.argv[1]):
        kind, args = check[0], check[1:]
        if kind == "env":
            out.append({"ok": True, "env": dict(os.environ)})
        elif kind == "exists":
            out.append({"ok": os.path.lexists(args[0])})
        elif kind == "uid":
            with open("/proc/self/status") as fh:
                caps = fh.read().split("CapEff:")[1].split()[0]
            out.append({"ok": True, "uid": os.getuid(), "caps": caps})
        elif kind == "uname":  # the kernel the workload runs on (microvm: the guest's, not the host's)
            with open("/proc/version") as fh:
                out.append({"ok": True, "release": os.uname().release, "version": fh.read().strip()})
        elif kind == "get":  # an HTTPS GET the way a well-behaved client does it (admission's proxy and CA)
            import urllib.request

            try:
                with urllib.request.urlopen(args[0], timeout=20) as resp:  # noqa: S310 - the test's https URL
                    out.append({"ok": True, "status": resp.status})
            except OSError as exc:
                out.append(err(exc))
        else:
            fn = {"tcp": tcp, "udp": udp, "dns": dns, "tls": tls, "raw": raw_socket, "icmp": icmp_dgram,
                  "open": open_file, "unix": unix, "pair": pair, "family": family, "pairfam": pair_family,
                  "vsock": vsock, "resolve": resolve, "sys": syscall, "keyring": keyring,
                  "dgram": dgram, "chmod": chmod}[kind]
            out.append(fn(*args))
    print(json.dumps(out))


main()
