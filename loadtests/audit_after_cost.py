"""CPU per request of the audit sink at c=1: one awaited decision record + one after-the-fact outcome.

Issue 11: `task` hands the outcome over as the gateway did before (`create_task(sink.write_after(...))`),
`enq` with `sink.enqueue_after(...)`. Run it against several source trees (each first on sys.path) to
compare them under the same load, e.g.

    git archive c92f914 egressgate | tar -x -C /tmp/base
    .venv/bin/python loadtests/audit_after_cost.py /tmp/base task 20000
    .venv/bin/python loadtests/audit_after_cost.py $PWD enq 20000
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = str(Path(__file__).resolve().parent.parent)  # for tests.support (the event factory)


async def run(mode: str, n: int) -> None:
    from egressgate.audit.filesink import FileSink
    from egressgate.audit.signer import LocalEd25519Signer
    from tests.support.audit_events import http_event

    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)  # as mitmproxy runs it
    d = Path(tempfile.mkdtemp(prefix="egressgate-aftercost-"))
    sink = await FileSink(d / "audit.jsonl", LocalEd25519Signer.load_or_create(d / "k.key"),
                          checkpoint_every=10**6).start()
    events = [(http_event(i), http_event(i, kind="outcome")) for i in range(n)]
    background: set = set()
    started = time.process_time()
    for decision, outcome in events:
        await sink.write(decision)
        if mode == "task":
            task = loop.create_task(sink.write_after(outcome))
            background.add(task)
            task.add_done_callback(background.discard)
        else:
            sink.enqueue_after(outcome)
        await asyncio.sleep(0)  # the loop goes idle between requests at c=1: the writer runs there
        await asyncio.sleep(0)
    await sink.close()
    spent = time.process_time() - started
    print(f"{mode:5s} {1e6 * spent / n:6.1f} us CPU per decision+outcome, {sink.batches_written} batches")


def main() -> None:
    tree, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.path[:0] = [tree, HERE]
    import egressgate
    assert egressgate.__file__.startswith(os.path.abspath(tree)), egressgate.__file__
    asyncio.run(run(mode, n))


if __name__ == "__main__":
    main()
