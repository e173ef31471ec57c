"""Signed checkpoints, and what happens when the signer (e.g. Vault transit) is down.

Why defer instead of failing: a checkpoint signature protects records that are *already durable*; refusing
them because Vault is unreachable would stop every route of every sandbox (within `checkpoint_every`
records) although only credentialed routes depend on Vault. So while the signer is down a checkpoint is
written *deferred* (unsigned, with the error), the records stay durable and allowed, and a background
probe waits for the signer; once it signs again the sink writes a signed checkpoint at once, which covers
every earlier line across files (each file's seq 0 links to the previous file's last hash). `audit verify`
lists the ranges that were signed late. The exposure is bounded: beyond `max_unsigned` records since the
last signature, checkpoints fail like a failed write (records refused, `audit_unavailable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from egressgate.audit.chain import ChainWriter
from egressgate.audit.event import AuditUnavailable
from egressgate.audit.record import Record
from egressgate.audit.signer import Signer

log = logging.getLogger(__name__)

# Probe signatures use their own domain: they can never be taken for a checkpoint signature.
PROBE_DOMAIN = b"egressgate-audit-signer-probe-v1\n"


class Checkpointer:
    """Makes checkpoint lines for the sink's writer task; tracks whether the signer is available."""

    def __init__(
        self,
        signer: Signer,
        clock: Callable[[], int],
        *,
        max_unsigned: int = 100_000,
        probe_interval: float = 1.0,
        sign_timeout: float = 10.0,
        on_restored: Callable[[], None] | None = None,
    ) -> None:
        self.signer = signer
        self._clock = clock
        self.max_unsigned = max_unsigned
        self.probe_interval = probe_interval
        self.sign_timeout = sign_timeout
        self.on_restored = on_restored
        self.available = True
        self.down_since: float | None = None  # unix seconds
        self.last_error: str | None = None
        self.deferred = 0  # deferred checkpoints written (counter)
        self._probe: asyncio.Task | None = None

    async def make(self, chain: ChainWriter, kind: str, extra: dict | None = None) -> tuple[bytes, Record]:
        """Append a checkpoint of `kind` to `chain`: signed when possible, else deferred (unsigned)."""
        now = self._clock()
        sig: bytes | None = None
        if self.available:
            try:
                sig = await asyncio.wait_for(
                    self.signer.sign(chain.checkpoint_payload(now, kind)), self.sign_timeout
                )
            except Exception as exc:  # any signer failure (Vault down, timeout, denied) defers
                self._went_down(exc)
        if sig is None:
            if chain.state.since_signed >= self.max_unsigned:
                raise AuditUnavailable(
                    f"{chain.state.since_signed} audit records are not covered by a signature and the signer "
                    f"is still unavailable ({self.last_error}); refusing more (audit.max_unsigned_records)"
                )
            self.deferred += 1
        rec = chain.checkpoint_record(
            now, self.signer.key_id, self.signer.algorithm, sig, kind, error=self.last_error, extra=extra
        )
        return chain.append(rec), rec

    def _went_down(self, exc: BaseException) -> None:
        self.available = False
        self.down_since = time.time()
        self.last_error = f"{type(exc).__name__}: {exc}"[:300]
        log.error(
            "audit checkpoint signer unavailable (%s): checkpoints are deferred (written unsigned) until it "
            "signs again; records are still written", self.last_error,
        )
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="audit-signer-probe")

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            try:
                await asyncio.wait_for(
                    self.signer.sign(PROBE_DOMAIN + str(time.time_ns()).encode()), self.sign_timeout
                )
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                continue
            log.warning(
                "audit checkpoint signer is back after %.1f s: signing the deferred range now",
                time.time() - (self.down_since or time.time()),
            )
            self.available = True
            self.down_since = None
            self.last_error = None
            if self.on_restored is not None:
                self.on_restored()
            return

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe

    def status(self) -> dict:
        return {
            "available": self.available,
            "down_since": self.down_since,
            "error": self.last_error,
            "deferred_checkpoints": self.deferred,
        }
