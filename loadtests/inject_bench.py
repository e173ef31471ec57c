"""Credential injection overhead through the real gateway (issue 5's ratio, goal >= 0.9x).

    .venv/bin/python -m loadtests.inject_bench [--seconds 4] [--repeats 3] [--concurrency 1 16]
                                               [--paths / /bytes/1048576] [--markdown FILE]

One `egressgate run` (embedded defaults: local broker backend, audit to a file) serves two sandboxes whose
policies differ only in `credential:` on the same HTTPS rule (loadtests/procs.py `bench_policy`): the
credential is a static secret from a 0600 file, cached by the broker, injected as `Authorization: Bearer`,
and every response is scrubbed (headers; bodies buffered below 64 KiB, streamed through the sliding-window
scrubber above). Cells alternate credentialed / plain per repeat (order swapped each repeat) so drift from
other load on the shared machine falls on both; figures are medians over repeats and the ratio is
median(cred rps) / median(plain rps). On a shared 2-core machine the gateway rarely gets a whole core, so
requests per gateway CPU-second (rps / the gateway process's CPU share, from /proc) is reported beside it:
it measures the cost per request and is far less sensitive to the neighbours' load.
Loopback only; every request must answer 200 with the full body.
Reuses the gateway benchmark's launcher and keep-alive load generator.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loadtests import procs
from loadtests.loadgen import Target, run_cell
from loadtests.upstream import SMALL_BODY


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def target(gw: procs.Proc, up: procs.Proc, sandbox_key: str, path: str) -> Target:
    port = up.info["https_port"]
    size = len(SMALL_BODY) if path == "/" else int(path.rsplit("/", 1)[1])
    return Target(scheme="https", host=procs.UPSTREAM_NAME, port=port, dial=("127.0.0.1", gw.info["port"]),
                  via_proxy=True, ca_file=gw.info["ca"], proxy_auth=gw.info[sandbox_key], path=path,
                  expect_body=size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--paths", nargs="+", default=["/", "/bytes/1048576"])
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    procs.check_loopback_name()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="inject-bench-") as tmp:
        d = Path(tmp)
        certs = procs.make_certs(d)
        up = procs.start_upstream(certs, d)
        gw = None
        try:
            gw = procs.start_egressgate(d, certs.ca_pem, up.info["http_port"], up.info["https_port"])
            log(f"egressgate up on {gw.info['port']} ({gw.info['cmd']})")
            # positive check: the credentialed sandbox really gets the credential path (audit key id)
            for rep in range(a.repeats):
                order = [("cred", "sandbox_cred"), ("plain", "sandbox")]
                if rep % 2:
                    order.reverse()
                for path in a.paths:
                    for conc in a.concurrency:
                        for label, key in order:
                            cpu0 = gw.cpu_seconds()
                            r = run_cell(target(gw, up, key, path), conc, a.seconds)
                            cpu = (gw.cpu_seconds() - cpu0) / a.seconds
                            rows.append({"rep": rep, "path": path, "conc": conc, "target": label, "rps": r.rps,
                                         "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors,
                                         "proxy_cpu": cpu, "req_per_cpu_s": r.rps / cpu if cpu else 0.0})
                            err = sum(r.errors.values())
                            log(f"rep {rep + 1} {path:16} c={conc:<3} {label:5} {r.rps:8.1f} rps  p50 "
                                f"{r.p50_ms:6.2f} ms  p99 {r.p99_ms:6.2f} ms  gw cpu {cpu:.2f}"
                                + (f"  ERRORS {r.errors}" if err else ""))
            audit_path = Path(gw.info["audit"])
            audit = "".join(f.read_text(errors="replace") for f in audit_path.parent.iterdir()
                            if f.name.startswith(audit_path.stem))  # the live file and rotated ones
            issued = audit.count('"credential_issue"')
            used = audit.count('"bench_token"')
        finally:
            if gw is not None:
                gw.stop()
            up.stop()
    summary = []
    for path in a.paths:
        for conc in a.concurrency:
            med = {}
            for label in ("cred", "plain"):
                cells = [r for r in rows if (r["path"], r["conc"], r["target"]) == (path, conc, label)]
                med[label] = {k: statistics.median(r[k] for r in cells)
                              for k in ("rps", "p50_ms", "p99_ms", "proxy_cpu", "req_per_cpu_s")}
                med[label]["errors"] = sum(sum(r["errors"].values()) for r in cells)
            summary.append({"path": path, "conc": conc, **{f"{lab}_{k}": v for lab in med for k, v in med[lab].items()},
                            "ratio": med["cred"]["rps"] / med["plain"]["rps"] if med["plain"]["rps"] else None,
                            "cpu_ratio": (med["cred"]["req_per_cpu_s"] / med["plain"]["req_per_cpu_s"]
                                          if med["plain"]["req_per_cpu_s"] else None)})
    cmd = "python -m loadtests.inject_bench " + " ".join(sys.argv[1:])
    md = [f"Command: `{cmd}` — {a.repeats} repeats x {a.seconds:g} s per cell, medians; "
          f"audit: {issued} credential_issue record(s), {used} record(s) naming the capability.", "",
          "| path | conc | plain rps | cred rps | ratio (goal >= 0.9) | req per gateway CPU-s plain / cred (ratio) | "
          "p50 ms plain / cred | p99 ms plain / cred | errors plain / cred |",
          "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        md.append(f"| {s['path']} | {s['conc']} | {s['plain_rps']:.0f} | {s['cred_rps']:.0f} | {s['ratio']:.2f} | "
                  f"{s['plain_req_per_cpu_s']:.0f} / {s['cred_req_per_cpu_s']:.0f} ({s['cpu_ratio']:.2f}) | "
                  f"{s['plain_p50_ms']:.2f} / {s['cred_p50_ms']:.2f} | {s['plain_p99_ms']:.1f} / "
                  f"{s['cred_p99_ms']:.1f} | {s['plain_errors']} / {s['cred_errors']} |")
    text = "\n".join(md)
    print(text)
    if a.markdown:
        a.markdown.write_text(text + "\n")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
