"""Start and stop the processes a gateway benchmark compares: upstream, mitmdump, Squid, egressgate.

Every server binds a loopback address; ports come from the OS (port 0) where the program reports the bound
port (upstream, mitmdump, egressgate); Squid cannot, so it gets a port the OS just handed out and released
(the only race, and a failed bind is a clear startup error). Each process is stopped by its own pid
(SIGTERM, then SIGKILL after a grace period); nothing is killed by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trustme
import yaml

VENV_BIN = Path(sys.executable).parent
EGRESSGATE = str(VENV_BIN / "egressgate")
MITMDUMP = str(VENV_BIN / "mitmdump")
UPSTREAM_NAME = "localhost"  # resolves to 127.0.0.1 via /etc/hosts (checked at startup)
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Polls host:port from inside a namespace (argv: host port timeout); exit 0 once it accepts, 1 at the timeout.
_PROBE = "\n".join([
    "import socket, sys, time",
    "host, port, end = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])",
    "while time.monotonic() < end:",
    "    try:",
    "        socket.create_connection((host, port), 0.5).close()",
    "        sys.exit(0)",
    "    except OSError:",
    "        time.sleep(0.05)",
    "sys.exit(1)",
])


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None, host: str = "127.0.0.1",
              prefix: Sequence[str] = ()) -> None:
    """Poll until `host:port` accepts (or `proc` exits, or `timeout`): from the namespace `prefix` runs commands
    in when one is given (the caller's own namespace may have no route there: a host-namespace caller's
    connect to a world address would leave through the host's default route), else from this process's."""
    if prefix:
        probe = subprocess.Popen([*prefix, sys.executable, "-I", "-S", "-c", _PROBE, host, str(port), str(timeout)])
        try:
            while probe.poll() is None:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
                time.sleep(0.05)
        finally:
            if probe.poll() is None:
                probe.kill()
            probe.wait()
        if probe.returncode != 0:
            raise RuntimeError(f"nothing listening on {host}:{port} after {timeout} s")
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {host}:{port} after {timeout} s")


def _first_line(proc: subprocess.Popen, timeout: float, needle: str | None = None) -> str:
    """Read stdout lines until one contains `needle` (or the first line); bounded by `timeout`."""
    box: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if needle is None or needle in line:
                box.append(line)
                break
        # keep draining so the child never blocks on a full pipe
        for _ in proc.stdout:
            pass

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not box and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    if not box:
        raise RuntimeError(f"no startup line (exit code {proc.poll()})")
    return box[0]


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    info: dict = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)
    remove: list[Path] = field(default_factory=list)  # private temp dirs deleted after stop

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """utime + stime of the process (all threads), from /proc."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def status(self, key: str) -> int:
        """A kB field of /proc/PID/status, e.g. VmHWM (peak RSS) or VmRSS."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` s: a profiled gateway needs longer (every process dumps its stats)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for path in self.remove:
            shutil.rmtree(path, ignore_errors=True)

    def log_tail(self, n: int = 2000) -> str:
        out = []
        for path in self.logs:
            with contextlib.suppress(OSError):
                out.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-n:])
        return "\n".join(out)


@dataclass
class Certs:
    ca_pem: Path
    cert_pem: Path
    key_pem: Path


def make_certs(directory: Path, names: Sequence[str] = (UPSTREAM_NAME, "127.0.0.1")) -> Certs:
    """A trustme CA and a server certificate for `names` (the upstream's identity: localhost / 127.0.0.1
    here, its name in the namespace world of loadtests/bench_procs.py)."""
    ca = trustme.CA()
    cert = ca.issue_cert(*names)
    certs = Certs(directory / "upstream-ca.pem", directory / "upstream-cert.pem", directory / "upstream-key.pem")
    ca.cert_pem.write_to_path(str(certs.ca_pem))
    cert.private_key_and_cert_chain_pem.write_to_path(str(certs.cert_pem))
    cert.private_key_pem.write_to_path(str(certs.key_pem))
    return certs


def start_upstream(certs: Certs, directory: Path, sse_gap: float = 2.0, prefix: Sequence[str] = (),
                   host: str = "127.0.0.1") -> Proc:
    """loadtests/upstream.py on `host` (HTTP and HTTPS, ports from the OS). `prefix` runs it elsewhere
    (`ip netns exec NS`, which execs: the Proc's pid is still the upstream's own)."""
    err = directory / "upstream.stderr"
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "loadtests.upstream", "--host", host, "--cert", str(certs.cert_pem),
         "--key", str(certs.key_pem), "--sse-gap", str(sse_gap)],
        stdout=subprocess.PIPE, stderr=err.open("w"), text=True, cwd=ROOT,
    )
    p = Proc("upstream", proc, logs=[err])
    try:
        p.info = json.loads(_first_line(proc, 20))
    except Exception:
        p.stop()
        raise RuntimeError("upstream did not start:\n" + p.log_tail()) from None
    p.info["http_port"] = int(p.info["http"].rsplit(":", 1)[1])
    p.info["https_port"] = int(p.info["https"].rsplit(":", 1)[1])
    return p


def upstream_stats(up: Proc) -> dict:
    """The upstream's counters (GET /__stats straight to it): requests, bearer_seen."""
    with socket.create_connection((up.info["http"].rsplit(":", 1)[0], up.info["http_port"]), 5) as s:
        s.sendall(b"GET /__stats HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and data.rstrip().endswith(b"}"):
                break
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


def start_mitmdump(directory: Path, upstream_ca: Path, flow_detail: int = 0, prefix: Sequence[str] = (),
                   host: str = "127.0.0.1") -> Proc:
    """Bare mitmdump: no scripts, mitmproxy's default addons and options except the upstream trust store
    (and flow_detail, the per-flow console line; 0 by default — see RESULTS.md). `prefix`: as start_upstream."""
    confdir = directory / "mitmdump-conf"
    confdir.mkdir(parents=True, exist_ok=True)
    log = directory / "mitmdump.out"
    cmd = [*prefix, MITMDUMP, "--listen-host", host, "--listen-port", "0", "--set", f"confdir={confdir}",
           "--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}", "--set", f"flow_detail={flow_detail}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    p = Proc("mitmdump", proc, logs=[log], info={"cmd": " ".join(cmd)})
    try:
        line = _first_line(proc, 30, needle="proxy listening at")
    except RuntimeError:
        p.stop()
        raise RuntimeError("mitmdump did not start:\n" + p.log_tail()) from None
    addr = line.rsplit("listening at", 1)[1].strip().rstrip(".")
    p.info["port"] = int(addr.rsplit(":", 1)[1])
    p.info["ca"] = str(confdir / "mitmproxy-ca-cert.pem")
    return p


SQUID_CONF = """\
# A plain forward proxy and CONNECT tunnel for the benchmarks: no cache, everything in its private dir.
http_port {addr}:{port}{port_options}
visible_hostname egressgate-bench
pid_filename {d}/squid.pid
cache_log {d}/cache.log
access_log {access_log}
cache_store_log none
coredump_dir {d}
cache deny all
cache_mem 0 MB
logfile_rotate 0
pinger_enable off
shutdown_lifetime 0 seconds
dns_nameservers 127.0.0.1
acl bench_clients src {net}
http_access allow bench_clients
http_access deny all
{extra}"""


def start_squid(directory: Path, prefix: Sequence[str] = (), addr: str = "127.0.0.1", port: int | None = None,
                net: str = "127.0.0.1/32", access_log: bool = True, name: str = "squid",
                setup: Callable[[Path], tuple[str, str]] | None = None) -> Proc:
    """Squid (Debian package) in the foreground (-N: one process): plain HTTP forwarding and CONNECT tunnels
    (no TLS MITM) on addr:port (a port the OS just handed out by default), open to clients in `net`.
    `prefix`: as start_upstream; the readiness probe then connects from here to addr:port. `setup(dir)`
    prepares files in Squid's private dir and returns (http_port options, extra config lines): how
    loadtests/bench_procs.py turns the same Squid into an ssl-bump MITM; `name` is also its service name
    (`-n`), so two Squids on one host keep their runtime objects apart."""
    squid = shutil.which("squid") or "/usr/sbin/squid"
    # Its own temp dir: squid runs as `proxy` and must traverse to it (the harness dir is 0700).
    d = Path(tempfile.mkdtemp(prefix=f"egressgate-bench-{name}-", dir=directory.parent))
    d.chmod(0o755)
    port = port or free_port()
    port_options, extra = setup(d) if setup is not None else ("", "")
    conf = d / "squid.conf"
    conf.write_text(SQUID_CONF.format(addr=addr, port=port, d=d, net=net, port_options=port_options, extra=extra,
                                      access_log=f"stdio:{d}/access.log" if access_log else "none"))
    if os.geteuid() == 0:  # squid drops to cache_effective_user (proxy); it must write its logs and pid
        with contextlib.suppress(KeyError):
            pw = pwd.getpwnam("proxy")
            for root, dirs, files in os.walk(d):
                for path in (root, *(os.path.join(root, x) for x in (*dirs, *files))):
                    os.chown(path, pw.pw_uid, pw.pw_gid)
    out = d / "squid.out"
    cmd = [*prefix, squid, "-N", "-n", name.replace("-", ""), "-f", str(conf)]
    proc = subprocess.Popen(cmd, stdout=out.open("w"), stderr=subprocess.STDOUT)
    p = Proc(name, proc, logs=[out, d / "cache.log"], info={"port": port, "cmd": " ".join(cmd)}, remove=[d])
    try:
        wait_port(port, 30, proc, host=addr, prefix=prefix)
    except RuntimeError as exc:
        p.stop()
        raise RuntimeError(f"{name} did not start: {exc}\n" + p.log_tail()) from None
    return p


def bench_policy(http_port: int, https_port: int, name: str = "bench", host: str = UPSTREAM_NAME,
                 credential_file: Path | None = None) -> dict:
    """The sandbox policy egressgate enforces in the benchmark: GETs to the upstream only, loopback opened
    explicitly with allow_private, a (large) byte budget so the budget path counts every byte. With
    `credential_file`, the HTTPS rule injects a static credential read from it (cached by the broker):
    the same route with and without injection, for issue 5's ratio."""
    paths = ["/", "/bytes/*", "/sse"]
    https_rule: dict = {"id": "bench-https", "host": host, "ports": [https_port], "methods": ["GET"], "paths": paths}
    extra: dict = {}
    if credential_file is not None:
        https_rule["credential"] = "bench_token"
        extra = {"credentials": {"capabilities": {"bench_token": {
            "type": "static", "source": {"file": str(credential_file)}, "ttl_seconds": 300,
            "placement": {"header": "Authorization", "format": "Bearer {value}"}}}}}
    return {
        **extra,
        "sandbox": {"name": name, "resources": {"outbound_bytes_max": 1 << 50}},
        "network": {
            "default": "deny",
            "allow_private": ["127.0.0.0/8"],
            "https": {"allow": [https_rule]},
            "http": {"allow": [{"id": "bench-http", "host": host, "ports": [http_port],
                                "methods": ["GET"], "paths": paths}]},
        },
    }


def start_egressgate(directory: Path, upstream_ca: Path, http_port: int, https_port: int,
                     extra_config: dict | None = None, name: str = "egressgate",
                     upstream_host: str = UPSTREAM_NAME, audit: bool = True) -> Proc:
    """`egressgate run --config FILE` with the full pipeline (identity, policy, pinning, budgets, audit to a
    file), then one sandbox admitted with the real `egressgate sandbox admit`. audit=False runs the same
    gateway through loadtests/gateway_noaudit.py (discard sink) for the audit on/off ratio."""
    d = directory / name
    (d / "policies").mkdir(parents=True, exist_ok=True)
    (d / "policies" / "bench.yaml").write_text(yaml.safe_dump(bench_policy(http_port, https_port, host=upstream_host)))
    secret = d / "bench-credential.txt"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("bench-secret-" + os.urandom(16).hex() + "\n")
    (d / "policies" / "bench-cred.yaml").write_text(yaml.safe_dump(
        bench_policy(http_port, https_port, name="bench-cred", host=upstream_host, credential_file=secret)))
    listen = {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": "127.0.0.2:0"}
    program = [EGRESSGATE, "run"] if audit else [sys.executable, "-m", "loadtests.gateway_noaudit"]
    return launch_egressgate(d, upstream_ca, listen, {"sandbox": "bench", "sandbox_cred": "bench-cred"},
                             name=name, extra_config=extra_config, program=program)


def launch_egressgate(d: Path, upstream_ca: Path, listen: dict, sandboxes: dict[str, str], name: str = "egressgate",
                      extra_config: dict | None = None, program: Sequence[str] = (EGRESSGATE, "run"),
                      prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> Proc:
    """Run `program --config d/gateway.yaml` (policies in d/policies, audit to a file under d/var) and, once
    it prints its startup line: its proxy port, one sandbox per policy admitted with the real `egressgate
    sandbox admit` (p.info[key] = (id, token)), its CA path and audit file. `prefix` runs the gateway and the
    CLI elsewhere (its admin API listens on that namespace's loopback). `env`: the gateway's own environment
    (not the CLI's; None: this process's), so gateways with different environments can start concurrently.
    Any failure stops the gateway and raises with its log."""
    config = {
        "listen": listen,
        "policy": str(d / "policies"),
        "var_dir": str(d / "var"),
        "upstream": {"resolver": "system", "ca_bundle": str(upstream_ca)},
        "audit": {"path": str(d / "var" / "audit" / "audit.jsonl")},
        **(extra_config or {}),
    }
    cfg = d / "gateway.yaml"
    cfg.write_text(yaml.safe_dump(config))
    err = d / "gateway.stderr"
    cmd = [*prefix, *program, "--config", str(cfg)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err.open("w"), text=True, cwd=ROOT, env=env)
    p = Proc(name, proc, logs=[err], info={"cmd": " ".join(cmd), "config": str(cfg)})
    try:
        addrs = json.loads(_first_line(p.proc, 60))
        p.info["port"] = int(addrs["proxy"].rsplit(":", 1)[1])
        for key, policy in sandboxes.items():
            admit = subprocess.run([*prefix, EGRESSGATE, "sandbox", "admit", "--config", str(cfg), "--policy",
                                    policy], capture_output=True, text=True, timeout=30)
            if admit.returncode != 0:
                raise RuntimeError(f"sandbox admit --policy {policy} failed: {admit.stdout} {admit.stderr}")
            sbx = json.loads(admit.stdout)
            p.info[key] = (sbx["id"], sbx["token"])
        p.info["ca"] = _ca_cert(d, config, cfg, prefix)
        p.info["audit"] = config["audit"]["path"]
    except Exception as exc:
        p.stop()
        raise RuntimeError(f"egressgate did not start: {exc}\n" + p.log_tail()) from None
    return p


def _ca_cert(d: Path, config: dict, cfg: Path, prefix: Sequence[str]) -> str:
    """The gateway's CA certificate, made by its start-up: <ca_dir>/mitmproxy-ca-cert.pem, ca_dir defaulting to
    <var_dir>/ca (egressgate/config.py ca_path, egressgate/gateway/service/ca.py CA_CERT). Read where this
    config puts it, not through `egressgate ca path`: a CLI start costs ~0.7 CPU-s per gateway. A config with
    its own ca_dir, or a file not there, asks the CLI."""
    cert = d / "var" / "ca" / "mitmproxy-ca-cert.pem"
    if "ca_dir" not in config and cert.is_file():
        return str(cert.resolve())
    ca = subprocess.run([*prefix, EGRESSGATE, "ca", "path", "--config", str(cfg)], capture_output=True, text=True,
                        timeout=30)
    if ca.returncode != 0:
        raise RuntimeError(f"ca path failed: {ca.stderr}")
    return ca.stdout.strip()


def check_loopback_name() -> None:
    addrs = {ai[4][0] for ai in socket.getaddrinfo(UPSTREAM_NAME, 80, type=socket.SOCK_STREAM)}
    if addrs != {"127.0.0.1"}:
        raise RuntimeError(f"{UPSTREAM_NAME} must resolve to 127.0.0.1 only for this benchmark, got {addrs}")
