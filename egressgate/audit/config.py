"""Audit settings (the `audit:` section of the gateway config) and the one function that opens the sink.

Why here and not in egressgate/config.py: the audit component owns its knobs and their validation; the
gateway config embeds this model (`audit: AuditSinkConfig`) and calls `open_audit_sink` at startup, so
every default is decided in one place and works with no config file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from egressgate.audit.filesink import FileSink
from egressgate.audit.signer import LocalEd25519Signer, Signer


class AuditSinkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    path: str | None = None  # default: <var_dir>/audit.jsonl
    local_file: bool = True  # False: OTLP exporter only (then an unreachable collector denies requests)
    max_bytes: int = Field(default=64 * 1024 * 1024, gt=0)  # rotate once the file reaches this size
    fsync: bool = False  # fsync every batch (survives power loss; written records already survive a crash)
    checkpoint_every: int = Field(default=1000, gt=0)  # signed checkpoint every N records
    on_failure: Literal["deny", "allow-and-alert"] = "deny"
    # while the checkpoint signer (e.g. Vault) is down, checkpoints are deferred; beyond this many records
    # since the last signature, records are refused (audit_unavailable) instead
    max_unsigned_records: int = Field(default=100_000, gt=0)
    # after-the-fact records (outcomes) waiting for a retry; at this many, new requests are denied
    retry_queue_max: int = Field(default=10_000, gt=0)
    # disk copy of that queue (survives kill -9); default <var_dir>/audit-retry.jsonl. Put it on another
    # volume than `path` when the audit file has its own
    retry_spool: str | None = None
    signing_key: str | None = None  # Ed25519 PEM, mode 0600, created if missing; default <var_dir>/audit-signing.key
    # who signs checkpoints: "auto" = the broker's Vault transit key when the broker is Vault, else the local key
    signer: Literal["auto", "local", "vault"] = "auto"
    transit_key: str = "egressgate-audit"  # the Vault transit key (ed25519) used when signing in Vault
    otlp_endpoint: str | None = None  # full OTLP/HTTP logs URL, e.g. http://collector:4318/v1/logs
    otlp_timeout_seconds: float = Field(default=5.0, gt=0)
    otlp_headers: dict[str, str] = {}

    @model_validator(mode="after")
    def _has_destination(self) -> AuditSinkConfig:
        if not self.local_file and not self.otlp_endpoint:
            raise ValueError("audit: local_file is false and no otlp_endpoint is set: records would go nowhere")
        return self

    def file_path(self, var_dir: Path) -> Path | None:
        if not self.local_file:
            return None
        return Path(self.path) if self.path else var_dir / "audit.jsonl"

    def key_path(self, var_dir: Path) -> Path:
        return Path(self.signing_key) if self.signing_key else var_dir / "audit-signing.key"


async def open_audit_sink(cfg: AuditSinkConfig, var_dir: str | Path, signer: Signer | None = None) -> FileSink:
    """Start the sink. `signer` lets the broker supply e.g. Vault transit signing; default: local key file."""
    var_dir = Path(var_dir)
    if signer is None:
        signer = LocalEd25519Signer.load_or_create(cfg.key_path(var_dir))
    exporter = None
    if cfg.otlp_endpoint:  # imported here: the OpenTelemetry SDK costs ~0.1 s of every gateway start
        from egressgate.audit.exporter import OtlpHttpExporter

        exporter = OtlpHttpExporter(cfg.otlp_endpoint, cfg.otlp_timeout_seconds, dict(cfg.otlp_headers) or None)
    sink = FileSink(
        cfg.file_path(var_dir),
        signer,
        max_bytes=cfg.max_bytes,
        fsync=cfg.fsync,
        checkpoint_every=cfg.checkpoint_every,
        on_failure=cfg.on_failure,
        exporter=exporter,
        max_unsigned=cfg.max_unsigned_records,
        pending_max=cfg.retry_queue_max,
        retry_spool=Path(cfg.retry_spool) if cfg.retry_spool else var_dir / "audit-retry.jsonl",
    )
    return await sink.start()
