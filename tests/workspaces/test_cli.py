"""`egressgate workspaces list|show|rm` on a var dir (runtimes/workspaces_cli.py). `rm` needs the running
gateway to record the removal: without one it refuses and removes nothing (the positive control, a removal
the gateway records, is in tests/runtimes/test_persistence.py)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from egressgate.runtimes import manifest
from egressgate.runtimes.workspaces import Store
from egressgate.runtimes.workspaces_cli import workspaces


def saved(var: Path, name: str) -> Store:
    store = Store(var, name=name)
    store.create()
    (store.data / "a.txt").write_text("a")
    entries = manifest.scan(store.data)
    store.store(
        {
            "name": name,
            "manifest_hash": manifest.manifest_hash(entries),
            "entries": entries,
            "policy": "p",
            "saved_at": 1.0,
            "inventory": {"file:requirements.txt": "0" * 64},
        }
    )
    return store


def test_list_and_show(tmp_path: Path) -> None:
    store = saved(tmp_path, "proj")
    runner = CliRunner()
    out = runner.invoke(workspaces, ["list", "--var-dir", str(tmp_path), "--format", "json"])
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.output)["workspaces"]
    assert row["workspace"] == "proj" and row["entries"] == 1 and row["pending_write"] is None
    table = runner.invoke(workspaces, ["list", "--var-dir", str(tmp_path)])
    assert "proj" in table.output and "sha256:" in table.output
    shown = json.loads(runner.invoke(workspaces, ["show", "proj", "--var-dir", str(tmp_path), "--files"]).output)
    assert shown["manifest"]["a.txt"]["size"] == 1 and shown["inventory"] == {"file:requirements.txt": "0" * 64}
    assert shown["manifest_hash"] == (store.load() or {})["manifest_hash"]
    missing = runner.invoke(workspaces, ["show", "nope", "--var-dir", str(tmp_path)])
    assert missing.exit_code != 0 and "no workspace" in missing.output


def test_rm_without_a_gateway_to_record_it_removes_nothing(tmp_path: Path) -> None:
    store = saved(tmp_path, "proj")
    out = CliRunner().invoke(workspaces, ["rm", "proj", "--var-dir", str(tmp_path)])
    assert out.exit_code != 0 and "cannot be recorded" in out.output
    assert (store.data / "a.txt").exists()
