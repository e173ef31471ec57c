"""Start the processes `make bench` compares, each inside its namespace of the bench world.

The upstream runs in `-up`, the proxies (Squid, bare mitmdump, egressgate) in `-gw`, all bound to their
namespace's 198.18.0.0/15 address (loadtests/bench_world.py). The process helpers of loadtests/procs.py are
reused (Proc: cpu/RSS from /proc, stop by pid; startup-line reader; the egressgate bench policy); what differs
from the loopback bench is only where each process runs and which address it binds. `ip netns exec` execs the
program, so a Proc's pid is the program's own pid (its /proc figures are the program's, not a wrapper's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import trustme
import yaml

from loadtests import procs
from loadtests.bench_world import ADDR, NET, UPSTREAM_NAME, World

SQUID_PORT = 3128  # the namespace is private: a fixed port cannot clash with anything
SQUID_BUMP_PORT = 3129
CERTGEN = Path("/usr/lib/squid/security_file_certgen")  # Debian's squid-openssl helper


def squid_bump_unavailable() -> str | None:
    """None if the installed Squid can ssl-bump (built with OpenSSL: Debian's squid-openssl), else why not."""
    squid = shutil.which("squid") or "/usr/sbin/squid"
    try:
        out = subprocess.run([squid, "-v"], capture_output=True, text=True, timeout=10).stdout
    except OSError as exc:
        return f"no squid: {exc}"
    if "--with-openssl" not in out:
        return "the installed Squid is not built with OpenSSL (Debian's GnuTLS `squid`); install squid-openssl"
    if not CERTGEN.exists():
        return f"{CERTGEN} is missing (part of squid-openssl)"
    return None


def make_certs(directory: Path) -> procs.Certs:
    """A trustme CA and the upstream's certificate for its name (what the client and the proxies verify)."""
    return procs.make_certs(directory, (UPSTREAM_NAME,))


def start_upstream(world: World, certs: procs.Certs, directory: Path) -> procs.Proc:
    return procs.start_upstream(certs, directory, prefix=world.exec_prefix("up"), host=ADDR["up"])


def start_squid(world: World, directory: Path) -> procs.Proc:
    """Debian's Squid in the foreground (-N: one process), private config, pid file and logs.

    access_log is off: mitmdump runs with flow_detail=0 and egressgate's audit is the pipeline under test;
    a per-request access log line would charge Squid for a feature the others do not pay for."""
    return procs.start_squid(directory, prefix=world.exec_prefix("gw"), addr=ADDR["gw"], port=SQUID_PORT, net=NET,
                             access_log=False)


def start_squid_bump(world: World, directory: Path, upstream_ca: Path, port: int = SQUID_BUMP_PORT,
                     name: str = "squid-bump") -> procs.Proc:
    """Squid as an ssl-bump MITM (the OpenSSL build): it terminates the client's TLS with a certificate it
    mints for the CONNECT host from its own trustme CA (security_file_certgen, cached in memory after the
    first), verifies the upstream against the upstream's CA only, and relays HTTP in between: the same job
    as mitmdump and egressgate's MITM. `ssl_bump bump all` bumps at the CONNECT (no peek/splice decision),
    like the other two. Its own process, port and private dir; p.info["ca"] is the only CA the client trusts
    on its cells, so a cell that was not intercepted fails its handshake."""
    why = squid_bump_unavailable()
    if why:
        raise RuntimeError(why)
    ca = trustme.CA(organization_name="egressgate bench squid ssl-bump")

    def setup(d: Path) -> tuple[str, str]:
        ca.cert_pem.write_to_path(str(d / "bump-ca.pem"))
        ca.private_key_pem.write_to_path(str(d / "bump-ca-key.pem"))
        shutil.copy(upstream_ca, d / "upstream-ca.pem")
        subprocess.run([str(CERTGEN), "-c", "-s", str(d / "ssl_db"), "-M", "16MB"], check=True,
                       capture_output=True, timeout=30)
        options = (f" ssl-bump generate-host-certificates=on dynamic_cert_mem_cache_size=16MB"
                   f" tls-cert={d}/bump-ca.pem tls-key={d}/bump-ca-key.pem")
        extra = (f"sslcrtd_program {CERTGEN} -s {d}/ssl_db -M 16MB\n"
                 "sslcrtd_children 2 startup=1 idle=1\n"
                 "ssl_bump bump all\n"
                 f"tls_outgoing_options cafile={d}/upstream-ca.pem\n"
                 "sslproxy_cert_error deny all\n")
        return options, extra

    p = procs.start_squid(directory, prefix=world.exec_prefix("gw"), addr=ADDR["gw"], port=port, net=NET,
                          access_log=False, name=name, setup=setup)
    p.info["ca"] = str(directory / f"{name}-ca.pem")
    ca.cert_pem.write_to_path(p.info["ca"])
    return p


def start_mitmdump(world: World, directory: Path, upstream_ca: Path) -> procs.Proc:
    """Bare mitmdump: no scripts, default addons and options except the upstream trust store and
    flow_detail=0 (no per-flow console line; as in loadtests/gateway_bench.py, see RESULTS.md)."""
    return procs.start_mitmdump(directory, upstream_ca, prefix=world.exec_prefix("gw"), host=ADDR["gw"])


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
    listen = {"proxy": f"{ADDR['gw']}:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None}
    return procs.launch_egressgate(d, upstream_ca, listen, sandboxes, prefix=world.exec_prefix("gw"))


def start_egressgate_baseline(world: World, directory: Path, upstream_ca: Path, http_port: int, https_port: int,
                              tree: Path | None) -> procs.Proc:
    """The same gateway and policy as start_egressgate, its code from `tree` (put first on its PYTHONPATH:
    the venv's console script then imports that tree's `egressgate`), for an A/B in one interleaved run.
    The CLI calls (`sandbox admit`, `ca path`) run from this tree: they only talk to its admin API."""
    if tree is None or not (tree / "egressgate" / "__init__.py").is_file():
        raise RuntimeError(f"--baseline {tree}: no egressgate/ package there")
    d = directory / "egressgate-base"
    pol = d / "policies"
    pol.mkdir(parents=True, exist_ok=True)
    (pol / "bench.yaml").write_text(yaml.safe_dump(world_policy(http_port, https_port)))
    listen = {"proxy": f"{ADDR['gw']}:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None}
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    return procs.launch_egressgate(d, upstream_ca, listen, {"sandbox": "bench"}, name="egressgate-base",
                                   prefix=world.exec_prefix("gw"), env=env)


def reset_peak_rss(p: procs.Proc) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0: `5` > /proc/PID/clear_refs), so the next
    VmHWM read is the peak of what ran in between. False if the kernel refused (then VmHWM is lifetime peak)."""
    try:
        Path(f"/proc/{p.pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True
