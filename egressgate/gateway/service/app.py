"""`egressgate run`: wire config, policies, state, audit, CA, the proxy and the admin API together.

Startup prints one JSON line with the bound addresses (tests and runtimes start it on port 0) and
writes the same to `var_dir/gateway.json` (0600) for `sandbox admit`. SIGTERM/SIGINT stop cleanly;
SIGHUP and a file watch reload the policy set atomically — an invalid new set keeps the old one and
logs every problem with its file and key path.

A worker of `run --workers N` (gateway/service/workers.py) runs the same Gateway on listening sockets its
supervisor bound (`listeners`) and leaves the runtime file to the supervisor (`publish=False`), which
writes it once for all workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
from pathlib import Path

from egressgate.admin.metrics_listener import MetricsListener, read_metrics_token
from egressgate.admin.server import AdminServer, ensure_admin_token
from egressgate.approvals.store import open_approvals
from egressgate.audit.build import build
from egressgate.audit.config import open_audit_sink
from egressgate.audit.event import EventKind
from egressgate.audit.signer import Signer
from egressgate.config import ConfigError, GatewayConfig, parse_listen
from egressgate.dns import DnsServer
from egressgate.dns.config import DnsConfig
from egressgate.gateway.master import GatewayMaster
from egressgate.gateway.mitm import hotpaths as mitm_hotpaths
from egressgate.gateway.mitm import typecheck
from egressgate.gateway.pipeline.budgets import ByteLedger
from egressgate.gateway.pipeline.credentials import check_broker, start_broker
from egressgate.gateway.service import ca, reconcile, varlock
from egressgate.gateway.service import listeners as shared_listeners
from egressgate.gateway.service.resolver import make_resolver
from egressgate.gateway.shared import emit
from egressgate.gateway.shared.context import PolicyHolder, Runtime
from egressgate.policy.errors import PolicyError
from egressgate.policy.loader import load_policies
from egressgate.state import open_state

logger = logging.getLogger(__name__)

WATCH_INTERVAL = 1.0


def policy_signature(path: Path) -> tuple:
    """Cheap change detector: names, sizes and mtimes of the policy file(s)."""
    try:
        files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml")) if path.is_dir() else [path]
        return tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)
    except OSError:
        return ()


class Gateway:
    def __init__(self, config: GatewayConfig, listeners: dict[str, socket.socket] | None = None,
                 publish: bool = True) -> None:
        self.config = config
        self.listeners = listeners or {}  # inherited listening sockets by kind (listeners.py)
        self.publish = publish  # own the var dir (varlock.py): write (and remove) var_dir/gateway.json
        self._claim: varlock.VarDirLock | None = None
        self._published = False  # this process wrote gateway.json: only then does stop() remove it
        self.rt: Runtime | None = None
        self.master: GatewayMaster | None = None
        self.admin: AdminServer | None = None
        self.dns: DnsServer | None = None
        self.metrics_site: MetricsListener | None = None
        self.addresses: dict[str, str] = {}
        self._watch: asyncio.Task | None = None
        self._signature: tuple = ()
        self._reload_lock = asyncio.Lock()

    async def start(self) -> dict[str, str]:
        cfg = self.config
        var = cfg.var_path()
        if self.publish:  # first: a refused start (VarDirBusy) touches nothing the running gateway owns
            self._claim = varlock.claim(var)
        var.mkdir(parents=True, exist_ok=True, mode=0o700)
        policy_path = Path(cfg.policy)
        self._signature = policy_signature(policy_path)
        policies = load_policies(policy_path)  # PolicyError: refuse to start
        sandbox_bundle = str(ca.sandbox_bundle(cfg.ca_path()).resolve())  # absolute: sandboxes run elsewhere
        upstream_bundle = str(ca.upstream_bundle(cfg.ca_path(), cfg.upstream.ca_bundle))
        broker = await start_broker(cfg, policies)  # refuses capabilities its backend cannot serve
        state = await open_state(cfg.state)  # memory or Redis (egressgate/state/__init__.py)
        sink = await open_audit_sink(cfg.audit, var, await audit_signer(cfg, broker))
        self.rt = rt = Runtime(
            config=cfg, policies=PolicyHolder(policies), state=state, audit=sink,
            resolver=make_resolver(cfg.upstream.resolver, cfg.upstream.connect_timeout),
            ledger=ByteLedger(state), upstream_bundle=upstream_bundle, sandbox_bundle=sandbox_bundle,
            broker=broker,
        )
        rt.approvals = open_approvals(state)  # approvals live in the state backend (egressgate/approvals)
        rt.listeners.extend(cfg.state.endpoints())  # never relay a sandbox to our own Redis (self_connection)
        token = ensure_admin_token(cfg.admin_token_path())
        admin_host, admin_port = parse_listen(cfg.listen.admin)
        self.admin = AdminServer(rt, token, reload=self.reload)
        admin_addr = await self.admin.start(admin_host, admin_port, self.listeners.get("admin"))
        rt.listeners.append(admin_addr)
        metrics_addr = None
        if cfg.listen.metrics is not None and cfg.admin.metrics_token_file is not None:  # the config pairs them
            self.metrics_site = MetricsListener(self.admin, read_metrics_token(Path(cfg.admin.metrics_token_file)))
            host, port = parse_listen(cfg.listen.metrics)
            metrics_addr = await self.metrics_site.start(host, port, self.listeners.get("metrics"))
            rt.listeners.append(metrics_addr)
        dns_addr = None
        if cfg.listen.dns:
            self.dns = DnsServer(rt.policies.get, state, sink, dns_resolver_config(cfg))
            inherited = (self.listeners["dns_udp"], self.listeners["dns_tcp"]) if "dns_udp" in self.listeners else None
            dns_addr = await self.dns.start(*parse_listen(cfg.listen.dns), sockets=inherited)
            rt.listeners.append(dns_addr)
        transparent = parse_listen(cfg.listen.transparent) if cfg.listen.transparent else None
        typecheck.install()  # mitmproxy's per-message type check, same verdicts, cheaper (typecheck.py)
        mitm_hotpaths.install()  # mitmproxy's per-hook task naming and watchdog, same effects (mitm/hotpaths.py)
        mitm_socks = [self.listeners[k] for k in ("proxy", "transparent") if k in self.listeners]
        if mitm_socks:
            shared_listeners.install_mitm(mitm_socks)
        self.master = GatewayMaster(rt, parse_listen(cfg.listen.proxy), transparent)
        bound = await self.master.start()
        proxy_addrs = bound["proxy"]
        rt.listeners.extend(proxy_addrs)
        rt.listeners.extend(bound["transparent"])
        proxy_host, proxy_port = proxy_addrs[0]
        rt.proxy_url_host = "127.0.0.1" if proxy_host in ("0.0.0.0", "::") else proxy_host
        rt.proxy_port = proxy_port
        self.addresses = {"proxy": _fmt(proxy_host, proxy_port), "admin": _fmt(*admin_addr)}
        if bound["transparent"]:  # where runtimes DNAT sandbox TCP (egressgate/runtimes/)
            self.addresses["transparent"] = _fmt(*bound["transparent"][0][:2])
        if dns_addr is not None:
            self.addresses["dns"] = rt.dns_address = _fmt(*dns_addr[:2])
        if metrics_addr is not None:
            self.addresses["metrics"] = _fmt(*metrics_addr)
        if self.publish:
            write_runtime_file(cfg, {**self.addresses, "pid": os.getpid()})
            self._published = True
        self._watch = asyncio.create_task(self._watch_policies(), name="policy-watch")
        reconcile.start(rt)  # ledger sweep + dead workers' leases (stopped by ledger.flush at stop)
        return self.addresses

    async def reload(self, reason: str = "signal") -> bool:
        """Load the policy set; swap it in only when every file is valid."""
        assert self.rt is not None
        async with self._reload_lock:
            path = Path(self.config.policy)
            self._signature = policy_signature(path)
            try:
                policies = await asyncio.to_thread(load_policies, path)
                check_broker(self.rt.broker, policies)
            except Exception as exc:  # any failure (not only PolicyError) keeps the previous set
                text = str(exc) if isinstance(exc, PolicyError) else f"{path}: {type(exc).__name__}: {exc}"
                for line in text.splitlines():
                    logger.error("policy reload rejected (%s), keeping the previous policies: %s", reason, line)
                await self._audit_reload(False, text)
                return False
            self.rt.policies.replace(policies)
            logger.info("policies reloaded (%s): %s", reason, ", ".join(sorted(policies)))
            await self._audit_reload(True, None, policies)
            return True

    async def _audit_reload(self, ok: bool, error: str | None, policies: dict | None = None) -> None:
        assert self.rt is not None
        extra = {"egressgate.policies": ",".join(f"{n}={p.hash}" for n, p in sorted((policies or {}).items()))}
        event = build(EventKind.POLICY_RELOAD, decision="allow" if ok else "deny",
                      message=error[:2000] if error else None, extra=extra)
        # the reload already happened (or was refused): its record is queued and retried, never dropped
        await emit.write_after(self.rt, event)

    async def _watch_policies(self) -> None:
        """Poll for changes until stopped. Nothing may end this loop but cancellation: a watcher that
        died on one bad file would never load the operator's fix (the previous set stays live)."""
        path = Path(self.config.policy)
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            try:
                signature = policy_signature(path)
                if signature != self._signature:
                    await self.reload("file change")
            except Exception:
                logger.exception("policy watcher: reload failed; keeping the previous policies and watching on")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.master is not None:
            await self.master.stop()
        if self.metrics_site is not None:
            await self.metrics_site.stop()
        if self.admin is not None:
            await self.admin.stop()
        if self.dns is not None:
            await self.dns.stop()
        if self.rt is not None:
            # a reload a SIGHUP started before the stop finishes first (the lock is FIFO): its policy_reload
            # record goes into this run's sealed file, not into the retry spool of a closed sink
            async with self._reload_lock:
                pass
            await self.rt.ledger.flush()
            if self.rt.background:  # write-behind outcome records: every one reaches the sink before close
                await asyncio.gather(*list(self.rt.background), return_exceptions=True)
            await self.rt.audit.close()
            await self.rt.state.close()
            if self.rt.broker is not None:
                await self.rt.broker.aclose()
        if self._published:
            with contextlib.suppress(OSError):
                self.config.runtime_path().unlink()
            self._published = False
        if self._claim is not None:  # after the unlink: the next gateway may publish at once
            self._claim.release()
            self._claim = None


async def audit_signer(cfg: GatewayConfig, broker) -> Signer | None:
    """Checkpoints are signed by the broker's key: Vault transit when the broker is Vault (the key never
    leaves Vault), else the local Ed25519 key file. A Vault signer that cannot be set up stops startup:
    an audit trail nobody can verify is not an audit trail."""
    use_vault = cfg.audit.signer == "vault" or (cfg.audit.signer == "auto" and cfg.broker.backend == "vault")
    if not use_vault:
        return None  # open_audit_sink loads or creates the local key
    if broker is None or getattr(broker.backend, "name", None) != "vault":
        raise ConfigError("audit.signer: vault needs broker.backend: vault")
    from egressgate.broker.signer import TransitSigner  # hvac loads only with a Vault broker (~0.1 s a start)

    try:
        return await TransitSigner.create(broker.backend, cfg.audit.transit_key)
    except Exception as exc:
        raise ConfigError(f"audit.transit_key: cannot use Vault transit key {cfg.audit.transit_key!r} "
                          f"to sign audit checkpoints: {exc}") from exc


def dns_resolver_config(cfg: GatewayConfig) -> DnsConfig:
    """The resolver's settings; denied names point at the gateway (`dns.gateway_answer`) only when a
    transparent listener is there to answer the connection (else the policy's deny rcode is answered)."""
    dns_config = cfg.dns.resolver_config()
    if not cfg.listen.transparent:
        return dataclasses.replace(dns_config, gateway_answer=None)
    networks = cfg.dns.gateway_answer_networks
    return dataclasses.replace(dns_config, gateway_answer_networks=tuple(networks or [cfg.runtime.subnet]))


def write_runtime_file(cfg: GatewayConfig, info: dict, audit_file: str | None = None) -> None:
    """var_dir/gateway.json (0600, atomic): the addresses, the pid to signal and what `sandbox run` needs
    besides (runtimes/endpoints.py reads it), published by the running gateway so the CLI needs no config
    parsing (start-up time) and uses exactly the settings the gateway runs with."""
    path = cfg.runtime_path()
    tmp = path.with_suffix(".tmp")
    audit = audit_file or (str(cfg.audit_path().absolute()) if cfg.audit_path() is not None else None)
    settings = {"runtime": {"subnet": cfg.runtime.subnet, "state_dir": str(Path(cfg.runtime.state_dir).absolute()),
                            "docker_host": cfg.runtime.docker_host, "uid_range": cfg.runtime.uid_range},
                "admin_token_file": str(cfg.admin_token_path().absolute()),
                "audit_file": audit}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({**info, **settings}, fh)
    tmp.replace(path)


def _fmt(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(config: GatewayConfig, announce=print, listeners: dict[str, socket.socket] | None = None,
                publish: bool = True) -> None:
    """Run until SIGTERM/SIGINT; SIGHUP reloads policies. `listeners`/`publish`: see Gateway."""
    gateway = Gateway(config, listeners, publish)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        addresses = await gateway.start()
    except BaseException:
        await gateway.stop()
        raise
    # handlers before the announcement: a supervisor may signal as soon as it reads the line
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(gateway.reload("SIGHUP")))
    announce(json.dumps(addresses))
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await gateway.stop()
