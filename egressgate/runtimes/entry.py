"""From command-line arguments to a run: which var dir (`--var-dir`, else `var_dir` of `--config`, else
./var) and the RunRequest. Kept apart from run.py (the run's lifecycle) because `mcp run` and `sandbox gc`
resolve the var dir the same way without running anything."""

from __future__ import annotations

from pathlib import Path

from egressgate.runtimes.base import EXIT_SETUP_FAILED
from egressgate.runtimes.run import RunRequest, log, run
from egressgate.runtimes.workload import SetupFailed

DEFAULT_VAR_DIR = "./var"  # GatewayConfig.var_dir's default (egressgate/config.py)


def var_dir_of(config_file: str | None, var_dir: str | None) -> Path:
    """--var-dir wins; else `var_dir` of --config (read without the config models); else ./var.
    SetupFailed names the problem."""
    if var_dir:
        return Path(var_dir)
    if config_file is None:
        return Path(DEFAULT_VAR_DIR)
    from egressgate.safeyaml import YamlError, load_yaml

    try:
        data = load_yaml(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, YamlError) as exc:
        raise SetupFailed(f"{config_file}: {exc}") from None
    value = data.get("var_dir", DEFAULT_VAR_DIR) if isinstance(data, dict) else DEFAULT_VAR_DIR
    if not isinstance(value, str):
        raise SetupFailed(f"{config_file}: var_dir: expected a string")
    return Path(value)


def run_from_args(config_file: str | None, var_dir: str | None, policy: str, runtime: str, image: str | None,
                  workspace: Path | str | None, labels: tuple[str, ...], command: tuple[str, ...],
                  accept_changes: bool = False, approval_ttl: int | None = None) -> int:
    """The `sandbox run` command (both the click command and the fast path of egressgate/cli.py land
    here); labels are already checked to be k=v. `workspace`: a name without '/' is a workspace the runtime
    keeps in its var dir (runtimes/workspaces.py); anything else is a host directory."""
    try:
        directory = var_dir_of(config_file, var_dir)
    except SetupFailed as exc:
        log(f"setup failed: {exc}")
        return EXIT_SETUP_FAILED
    name = None
    if isinstance(workspace, str):
        from egressgate.runtimes.workspaces import is_name

        if "/" not in workspace and not is_name(workspace):
            log(f"setup failed: --workspace {workspace!r} is neither a workspace name (lowercase letters, digits, "
                "'_.-') nor a path (give a directory as ./{workspace})")
            return EXIT_SETUP_FAILED
        name, workspace = (workspace, None) if is_name(workspace) else (None, Path(workspace))
    req = RunRequest(policy=policy, runtime=runtime, command=tuple(command), var_dir=directory,
                     workspace=workspace.absolute() if workspace else None, image=image,
                     labels=dict(label.split("=", 1) for label in labels), workspace_name=name,
                     accept_changes=accept_changes, approval_ttl=approval_ttl)
    return run(req)
