"""The c=1 cost of writing outcomes when the loop is idle (issue 23 item 4), against a baseline tree.

A c=1 client: one awaited decision record, the outcome handed over with `enqueue_after`, then the client's
round trip (`gap`, the loop idle) before the next decision. The baseline (a tree from before, e.g.
`git archive 2350e16 egressgate | tar -x -C /tmp/base`) always waits up to `after_delay` (2 ms) for a batch
to ride; this tree writes the outcome at idle while traffic is sparse (the last outcome was not followed
within 2 ms) and keeps the timer while it is dense. Figure: this process's CPU per request (the sink's whole
cost) and batches written, medians of interleaved runs, each in its own process with its tree first:

    .venv/bin/python -m loadtests.audit_idle_flush BASE_TREE [N] [GAP_US ...]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


async def run(n: int, gap: float) -> tuple[float, int]:
    from egressgate.audit.filesink import FileSink
    from egressgate.audit.signer import LocalEd25519Signer
    from tests.support.audit_events import http_event

    asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)  # as mitmproxy runs it
    d = Path(tempfile.mkdtemp(prefix="egressgate-idleflush-"))
    sink = await FileSink(
        d / "audit.jsonl", LocalEd25519Signer.load_or_create(d / "k.key"), checkpoint_every=10**6
    ).start()
    events = [(http_event(i), http_event(i, kind="outcome")) for i in range(n)]
    started = time.process_time()
    for decision, outcome in events:
        await sink.write(decision)
        sink.enqueue_after(outcome)
        await asyncio.sleep(gap)  # the client's round trip: the loop is idle
    await sink.close()
    return 1e6 * (time.process_time() - started) / n, sink.batches_written


def main() -> None:
    if sys.argv[1] == "--one":  # a child: TREE N GAP_US
        tree, n, gap_us = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        sys.path[:0] = [tree, HERE]
        import egressgate

        assert egressgate.__file__.startswith(os.path.abspath(tree)), egressgate.__file__
        us, batches = asyncio.run(run(n, gap_us / 1e6))
        print(us, batches)
        return
    base = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    gaps = [int(g) for g in sys.argv[3:]] or [300, 1000, 5000]
    trees = {"baseline": base, "this tree": HERE}
    for gap_us in gaps:
        got: dict[str, list[float]] = {k: [] for k in trees}
        batches: dict[str, int] = {}
        for _ in range(5):  # interleaved
            for name, tree in trees.items():
                out = subprocess.run(
                    [sys.executable, "-m", "loadtests.audit_idle_flush", "--one", tree, str(n), str(gap_us)],
                    cwd=HERE,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                us, b = out.split()
                got[name].append(float(us))
                batches[name] = int(b)
        load = Path("/proc/loadavg").read_text().split()[:3]
        med = {k: statistics.median(v) for k, v in got.items()}
        print(
            f"gap {gap_us:5d} us  load {' '.join(load)}  "
            + "  ".join(f"{k}: {med[k]:6.1f} us CPU/request ({batches[k]} batches / {n})" for k in got)
            + f"  this/baseline {med['this tree'] / med['baseline']:.2f}x",
            flush=True,
        )


HERE = str(Path(__file__).resolve().parent.parent)

if __name__ == "__main__":
    main()
