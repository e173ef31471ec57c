"""`egressgate run --workers N`: a supervisor process and N gateway worker processes.

Why processes: one event loop is one core (mitmproxy's hooks, TLS and the policy all run on it), so a
gateway host with more cores runs several workers. Each worker is a complete gateway (its own event
loop, mitmproxy master, DNS resolver and admin API) serving the listening sockets the supervisor bound
once (listeners.py says why inherited sockets and not SO_REUSEPORT). Everything the workers must agree
on lives in the shared state store, which is why several workers need `state.backend: redis`: with the
memory backend each worker would hold its own registry and budgets (a sandbox admitted by one worker is
unknown to the next, and every worker would grant the whole budget again), so that is refused.

The supervisor:
* creates what the workers would otherwise race to create (CA and trust bundles, admin token, audit and
  broker keys) and validates the policies, so a bad file stops `run` with one clear error;
* starts worker `i` (slot i) with its own audit file `audit.w<i>.jsonl` (and retry spool): a hash chain
  has one writer, and a restarted worker continues the chain of its slot from the last record;
* holds the var-dir lock (varlock.py) for all workers, writes `var_dir/gateway.json` once (its own pid:
  signal it, not a worker), prints the startup line, and removes gateway.json at the end only if it wrote it;
* restarts a worker that dies (with a back-off when it keeps dying), forwards SIGHUP to every worker and
  stops them all on SIGTERM/SIGINT. Workers run in their own process group (a terminal's ^C reaches only the
  supervisor, which stops them once and in order) and die with the supervisor (PR_SET_PDEATHSIG).

Workers are forked from the supervisor, not exec'd: it imports their modules once before its event loop
starts, and each child sheds the supervisor's loop, signal handlers and descriptors before it runs
(forking.py says why and what exactly). A worker gets its settings in memory, never in its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from egressgate.admin.server import ensure_admin_token
from egressgate.admin.ui.auth import ensure_role_tokens
from egressgate.audit.config import AuditSinkConfig
from egressgate.audit.signer import LocalEd25519Signer
from egressgate.config import ConfigError, GatewayConfig, ListenConfig
from egressgate.gateway.service import ca, varlock
from egressgate.gateway.service import listeners as shared
from egressgate.gateway.service.forking import Worker, fork_worker, preload
from egressgate.policy.loader import load_policies

logger = logging.getLogger(__name__)

START_TIMEOUT = 120.0  # a worker that has not announced its listeners by then is killed
STOP_TIMEOUT = 30.0  # SIGTERM -> SIGKILL for a worker that does not finish its graceful stop
STABLE_AFTER = 30.0  # a worker that ran this long is healthy again: the restart back-off starts over
MAX_BACKOFF = 30.0
_PR_SET_PDEATHSIG = 1


def check_workers(cfg: GatewayConfig, workers: int) -> None:
    """Refuse several workers on state that is not shared (the one place this rule is enforced)."""
    if workers > 1 and cfg.state.backend == "memory":
        raise ConfigError(
            f"--workers {workers} needs a shared state store: with state.backend memory each worker would keep "
            "its own sandboxes and budgets (a sandbox admitted by one worker is unknown to the others, and each "
            "worker would grant the whole budget again). Set `state: {backend: redis, url: redis://...}` in the "
            "config, or run with --workers 1")


def worker_file(path: Path, slot: int | str) -> Path:
    """`audit.jsonl` -> `audit.w<slot>.jsonl` (rotated: `audit.w<slot>.<stamp>.jsonl`, its own chain)."""
    return path.with_name(f"{path.stem}.w{slot}{path.suffix}")


def worker_audit(audit: AuditSinkConfig, var: Path, slot: int) -> AuditSinkConfig:
    """Slot `slot`'s audit settings: its own file and its own retry spool (one writer per chain)."""
    update: dict[str, str] = {}
    live = audit.file_path(var)
    if live is not None:
        update["path"] = str(worker_file(live, slot))
    update["retry_spool"] = str(worker_file(Path(audit.retry_spool) if audit.retry_spool
                                            else var / "audit-retry.jsonl", slot))
    return audit.model_copy(update=update)


def prepare_shared(cfg: GatewayConfig) -> None:
    """Create once, before any worker starts, what N workers would race to create; validate policies."""
    var = cfg.var_path()
    var.mkdir(parents=True, exist_ok=True, mode=0o700)
    load_policies(Path(cfg.policy))  # PolicyError: refuse to start, one message
    ca.sandbox_bundle(cfg.ca_path())
    ca.upstream_bundle(cfg.ca_path(), cfg.upstream.ca_bundle)
    ensure_admin_token(cfg.admin_token_path())
    ensure_role_tokens(var)  # the console's operator/auditor tokens (admin/ui/auth.py), same race
    if cfg.audit.signer == "local" or (cfg.audit.signer == "auto" and cfg.broker.backend != "vault"):
        LocalEd25519Signer.load_or_create(cfg.audit.key_path(var))
    broker = cfg.broker_config()
    if broker.backend == "local":
        from egressgate.broker.local import load_or_create_key

        load_or_create_key(broker.local_key_dir)


class Supervisor:
    def __init__(self, cfg: GatewayConfig, workers: int, log_level: str, log_format: str) -> None:
        self.cfg = cfg
        self.n = workers
        self.log = {"level": log_level, "format": log_format}
        self.socks: dict[str, socket.socket] = {}
        self.listen = cfg.listen  # with the ports actually bound, once bound
        self.procs: dict[int, Worker] = {}
        self.serving: set[int] = set()  # pids that announced their listeners (their signal handlers are set)
        self.stopping = asyncio.Event()
        self.failures: dict[int, int] = dict.fromkeys(range(workers), 0)
        self.published = False  # this supervisor wrote gateway.json: only then does it remove it

    def _spec(self, slot: int) -> dict:
        """What worker `slot` runs with, handed over in memory across the fork (never in its environment:
        the config may hold broker secrets). The models travel as their JSON dumps and are validated again
        in the worker (strict models accept exactly what they dumped), as when the spec came over a pipe."""
        audit = worker_audit(self.cfg.audit, self.cfg.var_path(), slot)
        return {"slot": slot, "parent": os.getpid(), "log": self.log, "fds": shared.descriptors(self.socks),
                "config": self.cfg.model_dump_json(exclude_unset=True),
                "listen": self.listen.model_dump_json(), "audit": audit.model_dump_json()}

    async def _spawn(self, slot: int) -> tuple[Worker, dict | None]:
        """Start slot `slot`; returns the process and its startup line (None: it exited or timed out)."""
        spec = self._spec(slot)
        read_fd, write_fd = os.pipe()
        try:
            pid = fork_worker(lambda: worker_main(spec, write_fd),
                              keep=(*shared.descriptors(self.socks).values(), write_fd))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.procs[slot] = proc = Worker(pid)
        logger.info("worker w%d started (pid %d)", slot, proc.pid)
        line = await _read_line(read_fd, START_TIMEOUT)
        try:
            info = json.loads(line) if line else None
        except ValueError:
            info = None
        if info is not None:
            self.serving.add(proc.pid)
        elif proc.returncode is None:
            logger.error("worker w%d (pid %d) did not announce its listeners in %.0fs: killing it",
                         slot, proc.pid, START_TIMEOUT)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        return proc, info

    async def _keep(self, slot: int, proc: Worker) -> None:
        """Restart slot `slot` whenever its worker dies, until the supervisor stops."""
        started = time.monotonic()
        while True:
            code = await proc.wait()
            if self.stopping.is_set():
                return
            ran = time.monotonic() - started
            self.failures[slot] = 1 if ran >= STABLE_AFTER else self.failures[slot] + 1
            delay = min(MAX_BACKOFF, 0.5 * 2 ** (self.failures[slot] - 1)) if ran < STABLE_AFTER else 0.0
            logger.error("worker w%d (pid %d) %s after %.1fs; restarting it%s", slot, proc.pid, _exit_text(code),
                         ran, f" in {delay:.1f}s" if delay else "")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)  # a stop during the back-off wins
            if self.stopping.is_set():
                return
            started = time.monotonic()
            proc, info = await self._spawn(slot)
            if info is not None:
                logger.info("worker w%d (pid %d) serving again", slot, proc.pid)

    def _reload_all(self) -> None:
        """SIGHUP to the workers that serve. A worker still starting has no handler yet (SIGHUP's default
        action would kill it) and loads the current policy files anyway."""
        self._signal_all(signal.SIGHUP, only_serving=True)

    def _signal_all(self, sig: int, only_serving: bool = False) -> None:
        for proc in self.procs.values():
            if proc.returncode is None and (not only_serving or proc.pid in self.serving):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    async def _stop_all(self, keepers: list[asyncio.Task]) -> None:
        """Stop restarting (keepers first, so none spawns a worker after the signal), then SIGTERM all."""
        self.stopping.set()
        for task in keepers:
            task.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)
        self._signal_all(signal.SIGTERM)
        waits = [p.wait() for p in self.procs.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), STOP_TIMEOUT)
        except TimeoutError:
            logger.error("worker(s) still running %.0fs after SIGTERM: killing them", STOP_TIMEOUT)
            self._signal_all(signal.SIGKILL)
            await asyncio.gather(*[p.wait() for p in self.procs.values()])

    async def run(self, announce) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload_all)
        self.socks = shared.bind_all(self.cfg.listen)
        self.listen = shared.bound_listen(self.cfg.listen, self.socks)
        keepers: list[asyncio.Task] = []
        try:
            started = await asyncio.gather(*(self._spawn(slot) for slot in range(self.n)))
            failed = [(slot, proc) for slot, (proc, info) in enumerate(started) if info is None]
            if failed or self.stopping.is_set():
                await self._stop_all(keepers)
                for slot, proc in failed:
                    logger.error("worker w%d (pid %d) %s before serving (its error is above)",
                                 slot, proc.pid, _exit_text(proc.returncode))
                return 1 if failed else 0
            info = started[0][1]
            assert info is not None
            from egressgate.gateway.service.app import write_runtime_file

            pattern = self.cfg.audit_path()
            write_runtime_file(self.cfg, {**info, "pid": os.getpid()},
                               str(worker_file(pattern.absolute(), "*")) if pattern is not None else None)
            self.published = True
            keepers = [asyncio.create_task(self._keep(slot, proc), name=f"keep-w{slot}")
                       for slot, (proc, _) in enumerate(started)]
            announce(json.dumps({**info, "pid": os.getpid(), "workers": [p.pid for p, _ in started]}))
            await self.stopping.wait()
            await self._stop_all(keepers)
            return 0
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            if self.published:
                with contextlib.suppress(OSError):
                    self.cfg.runtime_path().unlink()
            shared.close_all(self.socks)


async def _read_line(fd: int, timeout: float) -> str:
    """One line from a pipe ("" on EOF: the writer exited without it, or on timeout)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                os.fdopen(fd, "rb", buffering=0))
    try:
        return (await asyncio.wait_for(reader.readline(), timeout)).decode(errors="replace").strip()
    except TimeoutError:
        return ""
    finally:
        transport.close()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def supervise(cfg: GatewayConfig, workers: int, announce, log_level: str = "INFO", log_format: str = "text") -> int:
    """Run `workers` gateway processes until SIGTERM/SIGINT; the exit code. The caller has checked
    `check_workers` (cli.py) and configured logging. The var-dir lock (varlock.py) is taken first and held
    until the workers are gone: a refused start touches nothing a running gateway owns."""
    claim = varlock.claim(cfg.var_path())
    try:
        prepare_shared(cfg)
        preload()
        return asyncio.run(Supervisor(cfg, workers, log_level, log_format).run(announce))
    finally:
        claim.release()


# --- the worker process ---------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGTERM this worker when the supervisor dies (even by SIGKILL): a worker never outlives it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        sys.exit(1)


def worker_main(spec: dict, ready_fd: int) -> None:
    """A worker's life, in the child `fork_worker` made (started by Supervisor._spawn, never by hand)."""
    _die_with_parent(spec["parent"])
    from egressgate.gateway.service.cli import configure_logging, serve_or_fail

    configure_logging(spec["log"]["level"], spec["log"]["format"], worker=f"w{spec['slot']}")
    cfg = GatewayConfig.model_validate_json(spec["config"])
    cfg = cfg.model_copy(update={"listen": ListenConfig.model_validate_json(spec["listen"]),
                                 "audit": AuditSinkConfig.model_validate_json(spec["audit"])})
    socks = shared.inherit(spec["fds"])
    ready = os.fdopen(ready_fd, "w")

    def announce(line: str) -> None:
        ready.write(line + "\n")
        ready.close()

    import click

    try:
        serve_or_fail(cfg, announce, listeners=socks, publish=False)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
