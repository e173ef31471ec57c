"""Transparent-listener HTTPS rps vs explicit-proxy HTTPS rps, one gateway, one run (issue 10).

    .venv/bin/python -m loadtests.transparent_bench [--seconds 5] [--repeats 3] [--concurrency 1 16]

Both cells go through the same `egressgate run` (full pipeline, audit to a file) and the same sandbox
policy: `explicit` = CONNECT + Proxy-Authorization to listen.proxy, then TLS intercepted; `transparent`
= the client dials the upstream's port on 127.0.0.3 with TLS (SNI = the upstream name) and nothing else,
and an nftables `output` DNAT hands the connection to listen.transparent, which identifies the sandbox by
its source address (127.0.0.1, registered with `sandbox admit --address`) and pins the SNI itself.

SO_ORIGINAL_DST needs conntrack, so the whole run happens in a private network namespace
(`egT-bench-<hex>`, only `lo`), created here and deleted at the end: the host's own ruleset is never
touched. Cells are interleaved (explicit, transparent, then the other order on the next repeat); the
ratio is median transparent rps / median explicit rps at each concurrency (goal >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests import procs
from loadtests.loadgen import Target, run_cell
from loadtests.upstream import SMALL_BODY

DNAT_ADDR = "127.0.0.3"  # what the transparent client dials; only the DNAT rule knows where it leads
INNER = "EGRESSGATE_BENCH_NETNS"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def outer(argv: list[str]) -> int:
    """Run this module again inside a fresh namespace; delete the namespace (and anything left in it)."""
    ns = f"egT-bench-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        env = {**os.environ, INNER: ns}
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "loadtests.transparent_bench",
                               *argv], env=env, cwd=Path(__file__).resolve().parent.parent).returncode
    finally:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:  # only processes inside our own namespace
            subprocess.run(["kill", "-9", pid], check=False)
        subprocess.run(["ip", "netns", "del", ns], check=False)


def dnat(https_port: int, transparent: str) -> None:
    host, _, port = transparent.rpartition(":")
    ruleset = (f"table ip egT_bench {{\n chain out {{ type nat hook output priority -100; policy accept;\n"
               f"  ip daddr {DNAT_ADDR} tcp dport {https_port} dnat to {host}:{port}\n }}\n}}\n")
    subprocess.run(["nft", "-f", "-"], input=ruleset, text=True, check=True)


def inner(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="egT-bench-"))
    certs = procs.make_certs(work)
    procs.check_loopback_name()
    up = procs.start_upstream(certs, work)
    eg = None
    try:
        eg = procs.start_egressgate(work, certs.ca_pem, up.info["http_port"], up.info["https_port"])
        cfg = eg.info["config"]
        admit = subprocess.run([procs.EGRESSGATE, "sandbox", "admit", "--config", cfg, "--policy", "bench",
                                "--address", "127.0.0.1"], capture_output=True, text=True, timeout=30, check=True)
        log(f"transparent sandbox {json.loads(admit.stdout)['id']} at 127.0.0.1")
        runtime = json.loads((Path(cfg).parent / "var" / "gateway.json").read_text())
        https_port = up.info["https_port"]
        dnat(https_port, runtime["transparent"])
        common = {"scheme": "https", "host": procs.UPSTREAM_NAME, "port": https_port, "path": "/",
                  "expect_body": len(SMALL_BODY), "ca_file": eg.info["ca"]}
        targets = {
            "explicit": Target(dial=("127.0.0.1", eg.info["port"]), via_proxy=True,
                               proxy_auth=eg.info["sandbox"], **common),
            "transparent": Target(dial=(DNAT_ADDR, https_port), via_proxy=False, **common),
        }
        rows: list[dict] = []
        for rep in range(args.repeats):
            order = ["explicit", "transparent"] if rep % 2 == 0 else ["transparent", "explicit"]
            for conc in args.concurrency:
                for name in order:
                    cpu0 = eg.cpu_seconds()
                    r = run_cell(targets[name], conc, args.seconds)
                    cpu = (eg.cpu_seconds() - cpu0) / args.seconds
                    rows.append({"rep": rep, "conc": conc, "target": name, "rps": r.rps, "p50_ms": r.p50_ms,
                                 "p99_ms": r.p99_ms, "errors": r.errors, "gateway_cpu": cpu})
                    log(f"rep {rep + 1} c={conc:<3} {name:11} {r.rps:8.1f} rps  p50 {r.p50_ms:6.2f} ms  "
                        f"p99 {r.p99_ms:6.2f} ms  gateway cpu {cpu:.2f}" + (f"  ERRORS {r.errors}" if r.errors else ""))
        audit = Path(eg.info["audit"]).read_text()
        transparent_records = audit.count('"egressgate.mode"')
    finally:
        if eg is not None:
            eg.stop()
        up.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for conc in args.concurrency:
        med = {t: statistics.median(r["rps"] for r in rows if r["conc"] == conc and r["target"] == t)
               for t in targets}
        cpu = {t: statistics.median(r["gateway_cpu"] for r in rows if r["conc"] == conc and r["target"] == t)
               for t in targets}
        summary[conc] = {"explicit_rps": round(med["explicit"], 1), "transparent_rps": round(med["transparent"], 1),
                         "ratio": round(med["transparent"] / med["explicit"], 3) if med["explicit"] else None,
                         "rps_per_cpu_ratio": round((med["transparent"] / cpu["transparent"])
                                                    / (med["explicit"] / cpu["explicit"]), 3)
                         if all(cpu.values()) and med["explicit"] else None}
    return {"rows": rows, "summary": summary, "audit_records_with_mode": transparent_records,
            "errors": sum(sum(r["errors"].values()) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, audit file)")
    args = ap.parse_args()
    if not os.environ.get(INNER):
        sys.exit(outer(sys.argv[1:]))
    result = inner(args)
    for conc, s in result["summary"].items():
        log(f"c={conc}: explicit {s['explicit_rps']} rps, transparent {s['transparent_rps']} rps, "
            f"ratio {s['ratio']} (per gateway CPU-second: {s['rps_per_cpu_ratio']})")
    log(f"errors: {result['errors']}; audit records with egressgate.mode: {result['audit_records_with_mode']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
