"""`IndexFollower`: keep an `AuditIndex` caught up with the files a gateway is writing.

Why a thread and not the event loop: indexing reads and hashes whole files (a first build of a large trail
takes seconds) and SQLite calls block; the admin server's event loop must keep answering. The follower is
the index's writer; it never raises into the server: an error is logged, kept in `last_error`, and retried
at the next interval (the JSONL files stay the record of truth; a stale index only makes search slower to
see new records, and `record()` re-checks every byte it returns).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from egressgate.audit.index.model import IndexStats
from egressgate.audit.index.store import AuditIndex

log = logging.getLogger(__name__)


class IndexFollower:
    def __init__(self, index: AuditIndex, paths_fn: Callable[[], list[Path]], interval_s: float = 0.5) -> None:
        self.index = index
        self.paths_fn = paths_fn
        self.interval_s = interval_s
        self.last_stats: IndexStats | None = None
        self.last_error: str | None = None
        self.passes = 0  # completed add_files calls
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._pass_done = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self) -> IndexFollower:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="audit-index-follower", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.index.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.last_stats = self.index.add_files(self.paths_fn())
                self.last_error = None
            except Exception as exc:  # logged and retried: never kills the server
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("audit index: %s (retrying in %.1fs)", self.last_error, self.interval_s)
            with self._pass_done:
                self.passes += 1
                self._pass_done.notify_all()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def catch_up(self, timeout: float = 10.0) -> bool:
        """Block until a pass that STARTED after this call has finished (what was written before the call
        is then indexed). False on timeout or when the follower is not running."""
        with self._pass_done:
            target = self.passes + 2  # the pass running now may have listed the files before our call
        self._wake.set()
        deadline = time.monotonic() + timeout
        with self._pass_done:
            while self.passes < target:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._pass_done.wait(min(left, 0.1))
                self._wake.set()
        return True

    async def caught_up(self, timeout: float = 10.0) -> bool:
        """catch_up() for the event loop (runs in a worker thread)."""
        return await asyncio.to_thread(self.catch_up, timeout)
