"""`egressgate sandbox admit|list|show|revoke`: talk to the running gateway's local admin API."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from egressgate.config import GatewayConfig

# egressgate.config (pydantic) is imported inside the commands that need it: `sandbox run` lives in this
# group and must start fast (runtimes/cli.py; start-up measured in loadtests/).


def _config(config_file: str | None) -> GatewayConfig:
    from egressgate.config import ConfigError, load_config

    try:
        return load_config(config_file)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


def admin_url(cfg: GatewayConfig, override: str | None) -> str:
    """--admin wins; else the address a running gateway recorded (port 0 safe); else the config."""
    from egressgate.config import parse_listen

    if override:
        return override.rstrip("/")
    runtime = cfg.runtime_path()
    if runtime.is_file():
        try:
            return "http://" + json.loads(runtime.read_text())["admin"]
        except (ValueError, KeyError, OSError):
            pass
    host, port = parse_listen(cfg.listen.admin)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _token(cfg: GatewayConfig) -> str:
    path: Path = cfg.admin_token_path()
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise click.ClickException(f"cannot read admin token {path}: {exc.strerror} (is the gateway running?)") from exc


def _call(method: str, url: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    """One request to the loopback admin API with the stdlib (urllib): the CLI needs no HTTP client
    library beyond the runtime dependencies (httpx is only a test dependency)."""
    import urllib.error  # here: `sandbox run` shares this module and never needs urllib (start-up time)
    import urllib.request

    if not url.startswith(("http://", "https://")):  # urllib would also open file: and ftp: URLs
        raise click.ClickException(f"admin API URL must be http(s)://, got {url!r}")
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"Bearer {token}"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310 - checked above
    # An empty ProxyHandler: never send the admin token through an inherited HTTP(S)_PROXY.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as res:
            status, raw = res.status, res.read()
    except urllib.error.HTTPError as exc:  # a 4xx/5xx answer: its JSON body says why
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise click.ClickException(f"admin API unreachable at {url}: {exc}") from exc
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"error": raw.decode("utf-8", "replace")}


@click.group("sandbox")
def sandbox() -> None:
    """Admit, run and revoke sandboxes on the running gateway."""


@sandbox.command("admit")
@click.option("--config", "config_file", type=click.Path(dir_okay=False))
@click.option("--admin", "admin", help="Admin API base URL (default: from the running gateway)")
@click.option("--policy", required=True, help="Policy name (sandbox.name)")
@click.option("--label", "labels", multiple=True, help="k=v, repeatable")
@click.option("--address", "addresses", multiple=True,
              help="Source IP of the sandbox (repeatable): identifies it to the DNS resolver")
@click.option("--format", "fmt", type=click.Choice(["json", "shell", "env-file"]), default="json", show_default=True,
              help="json: everything; shell: `export` lines for eval; env-file: KEY=VALUE lines (docker --env-file)")
def admit(config_file: str | None, admin: str | None, policy: str, labels: tuple[str, ...],
          addresses: tuple[str, ...], fmt: str) -> None:
    """Register a sandbox; prints its id, token, proxy_url and the env to give it."""
    data = request_admission(_config(config_file), admin, policy, parse_labels(labels), list(addresses))
    click.echo(render_admission(data, fmt))
    note = unenforced_note(policy, (data.get("runtime_policy") or {}).get("keys") or [])
    if note:
        click.echo(note, err=True)


def unenforced_note(policy: str, keys: list[str]) -> str:
    """What a sandbox admitted by hand does not get (stderr, so eval/--env-file output is unchanged): the
    policy's keys only `sandbox run` enforces, and those nothing enforces (policy/enforcement.py)."""
    from egressgate.policy.enforcement import NAMED, REFUSED, RUNTIME

    runtime = [k for k in keys if k in NAMED and NAMED[k].by == RUNTIME]
    nobody = [k for k in keys if k not in NAMED or NAMED[k].by == REFUSED]
    parts = []
    if runtime:
        parts.append(f"egressgate: policy {policy!r} sets keys only `sandbox run` enforces ({', '.join(runtime)}): "
                     "a sandbox admitted by hand and routed through the gateway does not get them")
    if nobody:
        parts.append(f"egressgate: policy {policy!r} sets keys nothing enforces in this version ({', '.join(nobody)})")
    return "\n".join(parts)


def parse_labels(labels: tuple[str, ...]) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected k=v, got {item!r}", param_hint="--label")
        parsed[key] = value
    return parsed


def request_admission(cfg: GatewayConfig, admin: str | None, policy: str, labels: dict[str, str],
                      addresses: list[str]) -> dict:
    """POST /v1/sandboxes; the admission JSON, or a ClickException saying why the gateway refused.
    Shared by `sandbox admit` and `runtime admit` so both admit exactly the same way."""
    status, data = _call("POST", admin_url(cfg, admin) + "/v1/sandboxes", _token(cfg),
                         {"policy": policy, "labels": labels, "addresses": addresses})
    if status != 201:
        raise click.ClickException(f"admission refused ({status}): {json.dumps(data)}")
    return data


def render_admission(data: dict, fmt: str) -> str:
    """The sandbox's environment in the shape the caller wants. NO_PROXY is exported empty (an empty
    value overrides an inherited one); EGRESSGATE_SANDBOX_ID lets scripts revoke what they admitted."""
    if fmt == "json":
        return json.dumps(data, indent=2)
    env = {**data["env"], "EGRESSGATE_SANDBOX_ID": data["id"]}
    if fmt == "shell":
        return "\n".join(f"export {key}={shlex.quote(str(value))}" for key, value in env.items())
    for key, value in env.items():
        if "\n" in str(value):
            raise click.ClickException(f"{key} contains a newline; use --format json")
    return "\n".join(f"{key}={value}" for key, value in env.items())


@sandbox.command("revoke")
@click.option("--config", "config_file", type=click.Path(dir_okay=False))
@click.option("--admin", "admin", help="Admin API base URL (default: from the running gateway)")
@click.argument("sandbox_id")
def revoke(config_file: str | None, admin: str | None, sandbox_id: str) -> None:
    """Revoke a sandbox; its open connections are closed."""
    cfg = _config(config_file)
    status, data = _call("DELETE", admin_url(cfg, admin) + f"/v1/sandboxes/{sandbox_id}", _token(cfg))
    if status != 200:
        raise click.ClickException(f"revocation failed ({status}): {json.dumps(data)}")
    click.echo(json.dumps(data))


def _get(cfg: GatewayConfig, admin: str | None, path: str) -> dict:
    status, data = _call("GET", admin_url(cfg, admin) + path, _token(cfg))
    if status != 200:
        raise click.ClickException(f"{data.get('error', 'error')} ({status}): {data.get('message', json.dumps(data))}")
    return data


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


@sandbox.command("list")
@click.option("--config", "config_file", type=click.Path(dir_okay=False))
@click.option("--admin", "admin", help="Admin API base URL (default: from the running gateway)")
@click.option("--policy", help="Only sandboxes of this policy")
@click.option("--revoked/--active", "revoked", default=None, help="Only revoked / only active sandboxes")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON")
def list_cmd(config_file: str | None, admin: str | None, policy: str | None, revoked: bool | None,
             as_json: bool) -> None:
    """List admitted sandboxes (id, policy, state, open connections, labels)."""
    from urllib.parse import urlencode

    query = {k: v for k, v in (("policy", policy), ("revoked", None if revoked is None else str(revoked).lower()))
             if v is not None}
    data = _get(_config(config_file), admin, "/v1/sandboxes" + (f"?{urlencode(query)}" if query else ""))
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    rows = [["ID", "POLICY", "STATE", "CONNS", "LABELS"]]
    for sbx in data["sandboxes"]:
        labels = ",".join(f"{k}={v}" for k, v in sorted(sbx["labels"].items()))
        rows.append([sbx["id"], sbx["policy"], "revoked" if sbx["revoked"] else "active", str(sbx["connections"]),
                     labels])
    click.echo(_table(rows))


@sandbox.command("show")
@click.option("--config", "config_file", type=click.Path(dir_okay=False))
@click.option("--admin", "admin", help="Admin API base URL (default: from the running gateway)")
@click.argument("sandbox_id")
def show_cmd(config_file: str | None, admin: str | None, sandbox_id: str) -> None:
    """Show one sandbox as JSON: labels, policy, usage, budgets left, open connections."""
    from urllib.parse import quote as urlquote

    click.echo(json.dumps(_get(_config(config_file), admin, f"/v1/sandboxes/{urlquote(sandbox_id, safe='')}"),
                          indent=2))
