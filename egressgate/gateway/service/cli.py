"""`egressgate run` and `egressgate ca path|export`."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import click

from egressgate.config import ConfigError, GatewayConfig, load_config, parse_listen
from egressgate.dns.config import DnsConfigError
from egressgate.gateway.service import ca as ca_mod
from egressgate.gateway.service.varlock import VarDirBusy
from egressgate.logs import FORMATS, configure
from egressgate.policy.errors import PolicyError


def _config(config_file: str | None, policy: str | None = None, listen: dict[str, str | None] | None = None
            ) -> GatewayConfig:
    overrides: dict = {"policy": policy} if policy else {}
    if listen:
        overrides["listen"] = listen
    try:
        return load_config(config_file, overrides or None)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


# `run --listen-<kind>` / EGRESSGATE_LISTEN_<KIND>: listener addresses without a config file (one more gateway
# on a host, containers, systemd units), as mitmproxy's and smokescreen's flags do. Precedence is click's: a
# flag wins over its environment variable, and either wins over the config file's `listen.<kind>`. The ones a
# gateway can run without (dns, transparent) take `off` (the file's null).
LISTEN_KINDS = {"proxy": False, "transparent": True, "dns": True, "admin": False, "metrics": True}  # kind -> may be off
OFF = "off"


def _listen_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Validate one --listen-* value where it was given, so the error names the flag (or its variable)."""
    if value is None:
        return None
    assert param.name is not None
    kind = param.name.removeprefix("listen_")
    hint = f"'{param.opts[0]}'"
    if ctx.get_parameter_source(param.name) is click.core.ParameterSource.ENVIRONMENT:
        hint += f" (from ${param.envvar})"
    value = value.strip()
    if value.lower() in (OFF, "none", "null"):
        if not LISTEN_KINDS[kind]:
            raise click.BadParameter(f"the {kind} listener cannot be turned off", ctx, param_hint=hint)
        return OFF
    host = value.rpartition(":")[0]
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise click.BadParameter(f"{value!r}: put an IPv6 address in brackets, e.g. [::1]:8080", ctx, param_hint=hint)
    try:
        parse_listen(value)
    except ValueError as exc:
        raise click.BadParameter(f"{exc} (expected HOST:PORT with an IP address, e.g. 127.0.0.1:8080 or "
                                 "[::1]:8080; port 0 picks a free one)", ctx, param_hint=hint) from None
    return value


def _listen_options(func):
    """The --listen-* options (decorator), documented once."""
    for kind, may_be_off in reversed(LISTEN_KINDS.items()):
        func = click.option(
            f"--listen-{kind}", f"listen_{kind}", envvar=f"EGRESSGATE_LISTEN_{kind.upper()}", metavar="HOST:PORT",
            callback=_listen_option, show_envvar=True,
            help=f"Address of the {kind} listener (overrides listen.{kind} of the config)"
                 + ("; `off` turns it off." if may_be_off else "."))(func)
    return func


class _WorkerTag(logging.Filter):
    """Prefix every record's logger name with the worker slot (`w1/egressgate.gateway.service.app`), in any log
    format: several workers write to one stderr, and an operator must see which one spoke."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.tag + "/"):
            record.name = f"{self.tag}/{record.name}"
        return True


def configure_logging(level: str, fmt: str, worker: str | None = None) -> None:
    """The process's logging (egressgate/logs.py: text or JSON lines on stderr) and, in a worker of
    `run --workers N`, its slot on every record."""
    configure(level.upper(), fmt)
    if worker is not None:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_WorkerTag(worker))


def serve_or_fail(cfg: GatewayConfig, announce, **kwargs) -> None:
    """Run the gateway (app.serve); every startup failure becomes one ClickException with what to fix."""
    from egressgate.gateway.service.app import serve

    try:
        asyncio.run(serve(cfg, announce, **kwargs))
    except VarDirBusy as exc:  # already one sentence; the running gateway is untouched
        raise click.ClickException(str(exc)) from exc
    except PolicyError as exc:
        raise click.ClickException(f"invalid policy, not starting:\n{exc}") from exc
    except (ConfigError, DnsConfigError) as exc:
        raise click.ClickException(f"invalid config, not starting: {exc}") from exc
    except (OSError, RuntimeError, ca_mod.CAError) as exc:
        raise click.ClickException(f"gateway failed: {exc}") from exc


def _announce(line: str) -> None:
    click.echo(line)
    sys.stdout.flush()


@click.command("run")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="gateway.yaml (optional)")
@click.option("--policy", type=click.Path(), help="Policy file or directory (overrides the config)")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--log-format", default="text", show_default=True, type=click.Choice(list(FORMATS)),
              help="Log lines on stderr: text, or one JSON object per line (for a log collector).")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Gateway processes sharing the listeners (one event loop, i.e. one core, each); "
                   "more than 1 needs state.backend redis.")
@_listen_options
def run_cmd(config_file: str | None, policy: str | None, log_level: str, log_format: str, workers: int,
            **listen: str | None) -> None:
    """Start the gateway (proxy + admin API). Prints one JSON line with the bound addresses."""
    given = {key.removeprefix("listen_"): None if value == OFF else value
             for key, value in listen.items() if value is not None}
    cfg = _config(config_file, policy, given)
    configure_logging(log_level, log_format)
    if cfg.admin.metrics_token_file is not None:  # before any worker starts: one error, not one per worker
        from egressgate.admin.metrics_listener import MetricsTokenError, read_metrics_token

        try:
            read_metrics_token(Path(cfg.admin.metrics_token_file))
        except MetricsTokenError as exc:
            raise click.ClickException(f"invalid config, not starting: {exc}") from exc
    if cfg.state.password_file is not None:
        from egressgate.state.config import StatePasswordError

        try:
            cfg.state.connection_url()
        except StatePasswordError as exc:
            raise click.ClickException(f"invalid config, not starting: {exc}") from exc
    if workers == 1:
        serve_or_fail(cfg, _announce)
        return
    from egressgate.gateway.service import workers as workers_mod

    try:
        workers_mod.check_workers(cfg, workers)
        code = workers_mod.supervise(cfg, workers, _announce, log_level, log_format)
    except VarDirBusy as exc:
        raise click.ClickException(str(exc)) from exc
    except PolicyError as exc:
        raise click.ClickException(f"invalid policy, not starting:\n{exc}") from exc
    except ConfigError as exc:
        raise click.ClickException(f"invalid config, not starting: {exc}") from exc
    except (OSError, ca_mod.CAError) as exc:
        raise click.ClickException(f"gateway failed: {exc}") from exc
    if code:
        raise click.ClickException("gateway failed: a worker did not start (see its error above)")


@click.group("ca")
def ca_group() -> None:
    """The gateway CA that signs intercepted TLS (private key stays in ca_dir)."""


@ca_group.command("path")
@click.option("--config", "config_file", type=click.Path(dir_okay=False))
@click.option("--bundle", is_flag=True, help="Print the sandbox bundle (system roots + gateway CA) instead.")
def ca_path(config_file: str | None, bundle: bool) -> None:
    """Print the path of the CA certificate (created on first use)."""
    cfg = _config(config_file)
    path = ca_mod.sandbox_bundle(cfg.ca_path()) if bundle else ca_mod.ensure_ca(cfg.ca_path())
    click.echo(str(path.resolve()))


@ca_group.command("export")
@click.option("--config", "config_file", type=click.Path(dir_okay=False))
@click.option("--bundle", is_flag=True, help="Export system roots + gateway CA.")
def ca_export(config_file: str | None, bundle: bool) -> None:
    """Write the CA certificate (PEM, never the key) to stdout."""
    cfg = _config(config_file)
    path = ca_mod.sandbox_bundle(cfg.ca_path()) if bundle else ca_mod.ensure_ca(cfg.ca_path())
    click.echo(path.read_text(), nl=False)
