"""`egressgate run` and `egressgate ca path|export`."""

from __future__ import annotations

import asyncio
import logging
import sys

import click

from egressgate.config import ConfigError, GatewayConfig, load_config
from egressgate.dns.config import DnsConfigError
from egressgate.gateway import ca as ca_mod
from egressgate.policy.errors import PolicyError


def _config(config_file: str | None, policy: str | None = None) -> GatewayConfig:
    try:
        return load_config(config_file, {"policy": policy} if policy else None)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command("run")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="gateway.yaml (optional)")
@click.option("--policy", type=click.Path(), help="Policy file or directory (overrides the config)")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def run_cmd(config_file: str | None, policy: str | None, log_level: str) -> None:
    """Start the gateway (proxy + admin API). Prints one JSON line with the bound addresses."""
    cfg = _config(config_file, policy)
    logging.basicConfig(stream=sys.stderr, level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("mitmproxy", "hpack", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from egressgate.gateway.app import serve

    def announce(line: str) -> None:
        click.echo(line)
        sys.stdout.flush()

    try:
        asyncio.run(serve(cfg, announce))
    except PolicyError as exc:
        raise click.ClickException(f"invalid policy, not starting:\n{exc}") from exc
    except (ConfigError, DnsConfigError) as exc:
        raise click.ClickException(f"invalid config, not starting: {exc}") from exc
    except (OSError, RuntimeError, ca_mod.CAError) as exc:
        raise click.ClickException(f"gateway failed: {exc}") from exc


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
