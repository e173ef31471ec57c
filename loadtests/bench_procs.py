"""Start the processes `make bench` compares, each inside its namespace of the bench world.

The upstream runs in `-up`, the proxies (Squid, bare mitmdump, egressgate) in `-gw`, all bound to their
namespace's 198.18.0.0/15 address (loadtests/bench_world.py). The process helpers of loadtests/procs.py are
reused (Proc: cpu/RSS from /proc, stop by pid; startup-line reader; the egressgate bench policy); what differs
from the loopback bench is only where each process runs and which address it binds. `ip netns exec` execs the
program, so a Proc's pid is the program's own pid (its /proc figures are the program's, not a wrapper's).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from loadtests import procs
from loadtests.bench_world import ADDR, NET, UPSTREAM_NAME, World

SQUID_PORT = 3128  # the namespace is private: a fixed port cannot clash with anything


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


def reset_peak_rss(p: procs.Proc) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0: `5` > /proc/PID/clear_refs), so the next
    VmHWM read is the peak of what ran in between. False if the kernel refused (then VmHWM is lifetime peak)."""
    try:
        Path(f"/proc/{p.pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True
