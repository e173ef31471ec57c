"""How fast a large denied upload is refused (issue 21 item 2): milliseconds from the moment the client
starts sending its request to the first byte of the gateway's answer, while the client sends a 20 MiB body
(or, with `Expect: 100-continue`, waits for the answer). Goal: <= 50 ms after the headers.

The world is the tests' (tests/support/uploadworld.py): a real `egressgate run` on loopback, policy
`gw-bigdeny` (POST /allowed only), a counting upstream that must see no request head. The client is the
curl binary; the figure is curl's own `time_starttransfer - time_pretransfer` (pretransfer: the proxy's
CONNECT and both TLS handshakes are done, the request is about to go out; starttransfer: the answer's
first byte arrived), so process start and connection set-up are not in it. Kinds:

* `h1-cl`: HTTPS in a CONNECT tunnel, `Content-Length: 20 MiB`, no `Expect` (the body streams at once);
* `h1-chunked`: the same, chunked;
* `h1-expect`: `Content-Length` + `Expect: 100-continue` (curl's default above 1 MiB: it waits);
* `plain-cl`: plain HTTP through the proxy, 20 MiB streaming;
* `h2`: HTTP/2 in a CONNECT tunnel, 20 MiB streaming.
Control: `h1-allowed-small`, a 1 KiB POST to the allowed path (a full round trip through the upstream).

Usage: PYTHONPATH=$PWD .venv/bin/python loadtests/deny_upload_bench.py [--runs 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from tests.support.gwworld import open_world
from tests.support.uploadworld import UploadWorld, body_file, open_upload_world

MB = 1024 * 1024
KINDS = {  # kind: (path, url kind, size, curl options)
    "h1-cl": ("/denied", "tls", 20 * MB, ["--http1.1", "-H", "Expect:"]),
    "h1-chunked": ("/denied", "tls", 20 * MB, ["--http1.1", "-H", "Expect:", "-H", "Transfer-Encoding: chunked"]),
    "h1-expect": ("/denied", "tls", 20 * MB, ["--http1.1", "-H", "Expect: 100-continue"]),
    "plain-cl": ("/denied", "plain", 20 * MB, ["--http1.1", "-H", "Expect:"]),
    "h2": ("/denied", "h2", 20 * MB, ["--http2"]),
    "h1-allowed-small": ("/allowed", "tls", 1024, ["--http1.1"]),
}


def sample(uw: UploadWorld, sbx, kind: str) -> float:
    path, url_kind, size, opts = KINDS[kind]
    proxy = f"http://{sbx.id}:{sbx.token}@{uw.gw.proxy[0]}:{uw.gw.proxy[1]}"
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    res = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "--max-time", "60", "--cacert", uw.gw.bundle, "-x", proxy,
         "--data-binary", f"@{body_file(uw.files, size)}", *opts,
         "-w", "%{http_code} %{time_pretransfer} %{time_starttransfer}", uw.url(path, url_kind)],
        capture_output=True, text=True, timeout=90, env=env, check=False)
    code, pre, first = res.stdout.split()
    want = "200" if path == "/allowed" else "403"
    assert code == want, (kind, res.stdout, res.stderr)
    return float(first) - float(pre)


def measure(uw: UploadWorld, runs: int) -> dict[str, list[float]]:
    sbx = uw.admit()
    for kind in KINDS:  # warm: certificates, TLS contexts, connections' first use
        sample(uw, sbx, kind)
    mark = uw.seen.mark()
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(runs):
        for kind in KINDS:
            out[kind].append(sample(uw, sbx, kind))
    heads = [e for e in uw.seen.since(mark) if e["event"] == "start" and e["path"] != "/allowed"]
    assert heads == [], heads  # the upstream never saw a denied request
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deny-upload-") as tmp:
        for sub in ("world", "uw"):
            (Path(tmp) / sub).mkdir()
        with open_world(Path(tmp) / "world") as world, open_upload_world(world, Path(tmp) / "uw") as uw:
            times = measure(uw, args.runs)
    print(f"ms from the request going out to the answer's first byte (curl), {args.runs} runs each")
    print(f"  {'kind':17} {'p50':>7} {'p95':>7} {'max':>7}")
    for kind, values in times.items():
        ms = sorted(v * 1000 for v in values)
        p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
        print(f"  {kind:17} {statistics.median(ms):7.1f} {p95:7.1f} {ms[-1]:7.1f}")
    denied = [k for k in KINDS if KINDS[k][0] == "/denied"]
    worst = max(statistics.median(times[k]) * 1000 for k in denied)
    print(f"  worst median of the denied kinds: {worst:.1f} ms (goal <= 50 ms)")
    if args.json:
        args.json.write_text(json.dumps({"runs": args.runs, "seconds": times}, indent=1))


if __name__ == "__main__":
    main()
