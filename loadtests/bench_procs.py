"""Start the processes `make bench` compares, each inside its namespace of the bench world.

The upstream runs in `-up`, the proxies (Squid, bare mitmdump, egressgate) in `-gw`, all bound to their
namespace's 198.18.0.0/15 address (loadtests/bench_world.py). The process helpers of loadtests/procs.py are
reused (Proc: cpu/RSS from /proc, stop by pid; startup-line reader; the egressgate bench policy); what differs
from the loopback bench is only where each process runs and which address it binds. `ip netns exec` execs the
program, so a Proc's pid is the program's own pid (its /proc figures are the program's, not a wrapper's).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import trustme
import yaml

from loadtests import procs
from loadtests.bench_world import ADDR, NET, UPSTREAM_NAME, World

ROOT = Path(__file__).resolve().parent.parent
SQUID_PORT = 3128  # the namespace is private: a fixed port cannot clash with anything


def make_certs(directory: Path) -> procs.Certs:
    """A trustme CA and the upstream's certificate for its name (what the client and the proxies verify)."""
    ca = trustme.CA()
    cert = ca.issue_cert(UPSTREAM_NAME)
    certs = procs.Certs(directory / "upstream-ca.pem", directory / "upstream-cert.pem", directory / "upstream-key.pem")
    ca.cert_pem.write_to_path(str(certs.ca_pem))
    cert.private_key_and_cert_chain_pem.write_to_path(str(certs.cert_pem))
    cert.private_key_pem.write_to_path(str(certs.key_pem))
    return certs


def start_upstream(world: World, certs: procs.Certs, directory: Path) -> procs.Proc:
    err = directory / "upstream.stderr"
    cmd = [*world.exec_prefix("up"), sys.executable, "-m", "loadtests.upstream", "--host", ADDR["up"],
           "--cert", str(certs.cert_pem), "--key", str(certs.key_pem)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err.open("w"), text=True, cwd=ROOT)
    p = procs.Proc("upstream", proc, logs=[err])
    try:
        p.info = json.loads(procs._first_line(proc, 20))
    except Exception:
        p.stop()
        raise RuntimeError("upstream did not start:\n" + p.log_tail()) from None
    p.info["http_port"] = int(p.info["http"].rsplit(":", 1)[1])
    p.info["https_port"] = int(p.info["https"].rsplit(":", 1)[1])
    return p


SQUID_CONF = """\
# `make bench`: a plain forward proxy and CONNECT tunnel, no cache, everything in this private dir.
http_port {addr}:{port}
visible_hostname egressgate-bench
pid_filename {d}/squid.pid
cache_log {d}/cache.log
access_log none
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
"""


def start_squid(world: World, directory: Path) -> procs.Proc:
    """Debian's Squid in the foreground (-N: one process), private config, pid file and logs.

    access_log is off: mitmdump runs with flow_detail=0 and egressgate's audit is the pipeline under test;
    a per-request access log line would charge Squid for a feature the others do not pay for."""
    squid = shutil.which("squid") or "/usr/sbin/squid"
    # its own dir under the temp root: squid drops to `proxy` and must traverse to it (mkdtemp dirs are 0700)
    d = Path(tempfile.mkdtemp(prefix="egB-bench-squid-", dir=directory.parent))
    d.chmod(0o755)
    conf = d / "squid.conf"
    conf.write_text(SQUID_CONF.format(addr=ADDR["gw"], port=SQUID_PORT, d=d, net=NET))
    if os.geteuid() == 0:
        with contextlib.suppress(KeyError):
            pw = pwd.getpwnam("proxy")
            for path in (d, *d.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
    out = d / "squid.out"
    cmd = [*world.exec_prefix("gw"), squid, "-N", "-f", str(conf)]
    proc = subprocess.Popen(cmd, stdout=out.open("w"), stderr=subprocess.STDOUT)
    p = procs.Proc("squid", proc, logs=[out, d / "cache.log"], info={"port": SQUID_PORT, "cmd": " ".join(cmd)},
                   remove=[d])
    try:
        _wait_listening(world, SQUID_PORT, proc)
    except RuntimeError as exc:
        p.stop()
        raise RuntimeError(f"squid did not start: {exc}\n" + p.log_tail()) from None
    return p


def _wait_listening(world: World, port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Poll from the client namespace (the driver runs there) until the proxy accepts."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((ADDR["gw"], port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {ADDR['gw']}:{port} after {timeout} s")


def start_mitmdump(world: World, directory: Path, upstream_ca: Path) -> procs.Proc:
    """Bare mitmdump: no scripts, default addons and options except the upstream trust store and
    flow_detail=0 (no per-flow console line; as in loadtests/gateway_bench.py, see RESULTS.md)."""
    confdir = directory / "mitmdump-conf"
    confdir.mkdir(parents=True, exist_ok=True)
    log = directory / "mitmdump.out"
    cmd = [*world.exec_prefix("gw"), procs.MITMDUMP, "--listen-host", ADDR["gw"], "--listen-port", "0",
           "--set", f"confdir={confdir}", "--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}",
           "--set", "flow_detail=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    p = procs.Proc("mitmdump", proc, logs=[log], info={"cmd": " ".join(cmd)})
    try:
        line = procs._first_line(proc, 30, needle="proxy listening at")
    except RuntimeError:
        p.stop()
        raise RuntimeError("mitmdump did not start:\n" + p.log_tail()) from None
    addr = line.rsplit("listening at", 1)[1].strip().rstrip(".")
    p.info["port"] = int(addr.rsplit(":", 1)[1])
    p.info["ca"] = str(confdir / "mitmproxy-ca-cert.pem")
    return p


def world_policy(http_port: int, https_port: int, name: str = "bench", passthrough: bool = False) -> dict:
    """loadtests/procs.py's bench policy, for the upstream's name and address in this world: the same rules
    (GET /, /bytes/*, /sse; a byte budget so every byte is counted), 198.18.0.0/15 opened with
    allow_private. passthrough=True: one https rule with `tls: passthrough` (no methods/paths: L7 keys are
    refused on such a rule) and no plain-HTTP rule."""
    policy = procs.bench_policy(http_port, https_port, name=name, host=UPSTREAM_NAME)
    policy["network"]["allow_private"] = [NET]
    if passthrough:
        policy["network"]["https"] = {"allow": [{"id": "bench-passthrough", "host": UPSTREAM_NAME,
                                                 "ports": [https_port], "tls": "passthrough"}]}
        del policy["network"]["http"]
    return policy


def passthrough_unavailable(https_port: int) -> str | None:
    """None if the installed policy engine accepts a `tls: passthrough` rule, else why not (one line)."""
    text = yaml.safe_dump(world_policy(1, https_port, name="bench-pt", passthrough=True))
    try:
        from egressgate.policy.loader import parse_policy

        parse_policy(text, "bench-pt.yaml")
    except Exception as exc:  # PolicyError (unknown key `tls`) on a tree without passthrough routes
        return "the policy engine refuses `tls: passthrough`: " + " ".join(str(exc).split())[:200]
    return None


def start_egressgate(world: World, directory: Path, upstream_ca: Path, http_port: int, https_port: int,
                     passthrough: bool) -> procs.Proc:
    """`egressgate run` (full pipeline: identity, policy, pinning, budgets, audit to a file) in the gateway
    namespace, and its sandboxes admitted with the real `egressgate sandbox admit`: `sandbox` (MITM HTTPS and
    plain HTTP rules) and, with passthrough, `sandbox_pt` (the same upstream on a `tls: passthrough` rule)."""
    d = directory / "egressgate"
    pol = d / "policies"
    pol.mkdir(parents=True, exist_ok=True)
    (pol / "bench.yaml").write_text(yaml.safe_dump(world_policy(http_port, https_port)))
    sandboxes = {"sandbox": "bench"}
    if passthrough:
        (pol / "bench-pt.yaml").write_text(yaml.safe_dump(world_policy(http_port, https_port, "bench-pt", True)))
        sandboxes["sandbox_pt"] = "bench-pt"
    config = {
        "listen": {"proxy": f"{ADDR['gw']}:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
        "policy": str(pol),
        "var_dir": str(d / "var"),
        "upstream": {"resolver": "system", "ca_bundle": str(upstream_ca)},
        "audit": {"path": str(d / "var" / "audit" / "audit.jsonl")},
    }
    cfg = d / "gateway.yaml"
    cfg.write_text(yaml.safe_dump(config))
    err = d / "gateway.stderr"
    cmd = [*world.exec_prefix("gw"), procs.EGRESSGATE, "run", "--config", str(cfg)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err.open("w"), text=True, cwd=ROOT)
    p = procs.Proc("egressgate", proc, logs=[err], info={"cmd": " ".join(cmd), "config": str(cfg)})
    gw = world.exec_prefix("gw")
    try:
        addrs = json.loads(procs._first_line(proc, 60))
        p.info["port"] = int(addrs["proxy"].rsplit(":", 1)[1])
        for key, policy in sandboxes.items():
            admit = subprocess.run([*gw, procs.EGRESSGATE, "sandbox", "admit", "--config", str(cfg), "--policy",
                                    policy], capture_output=True, text=True, timeout=30)
            if admit.returncode != 0:
                raise RuntimeError(f"sandbox admit --policy {policy} failed: {admit.stdout} {admit.stderr}")
            sbx = json.loads(admit.stdout)
            p.info[key] = (sbx["id"], sbx["token"])
        ca = subprocess.run([*gw, procs.EGRESSGATE, "ca", "path", "--config", str(cfg)], capture_output=True,
                            text=True, timeout=30)
        if ca.returncode != 0:
            raise RuntimeError(f"ca path failed: {ca.stderr}")
        p.info["ca"] = ca.stdout.strip()
        p.info["audit"] = config["audit"]["path"]
    except Exception as exc:
        p.stop()
        raise RuntimeError(f"egressgate did not start: {exc}\n" + p.log_tail()) from None
    return p


def reset_peak_rss(p: procs.Proc) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0: `5` > /proc/PID/clear_refs), so the next
    VmHWM read is the peak of what ran in between. False if the kernel refused (then VmHWM is lifetime peak)."""
    try:
        Path(f"/proc/{p.pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True
