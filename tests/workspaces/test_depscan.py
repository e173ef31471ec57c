"""The dependency inventory (runtimes/depscan.py): manifests and installed packages found in a workspace
manifest, and what changed between two runs. Pure: a manifest and a reader."""

from __future__ import annotations

import json

from egressgate.runtimes.depscan import inventory, inventory_diff, summary


def f(sha: str = "0" * 64) -> dict:
    return {"t": "f", "mode": 0o644, "size": 1, "sha256": sha}


D = {"t": "d", "mode": 0o755}
PKG = {
    "node_modules/left-pad/package.json": json.dumps({"name": "left-pad", "version": "1.3.0"}).encode(),
    "node_modules/@types/node/package.json": json.dumps({"version": "20.1.0"}).encode(),
    "app/node_modules/x/package.json": b"{not json",
}


def entries(**changes: dict) -> dict:
    base = {
        "requirements.txt": f("a" * 64),
        "requirements-dev.txt": f("b" * 64),
        "pyproject.toml": f("c" * 64),
        "uv.lock": f("d" * 64),
        "poetry.lock": f("e" * 64),
        "package.json": f(),
        "package-lock.json": f(),
        "src/notes.txt": f(),
        ".venv/lib/python3.11/site-packages": D,
        ".venv/lib/python3.11/site-packages/requests-2.32.0.dist-info": D,
        ".venv/lib/python3.11/site-packages/requests": D,
        ".venv/lib/python3.11/site-packages/requests/package.json": f(),  # inside an installed tree: not a manifest
        "node_modules/left-pad/package.json": f(),
        "node_modules/@types/node/package.json": f(),
        "node_modules/left-pad/lib/package.json": f(),  # a nested file, not a package
        "app/node_modules/x/package.json": f(),
    }
    base.update(changes)
    return base


def read(path: str) -> bytes | None:
    return PKG.get(path)


def test_inventory_finds_manifests_and_installed_packages() -> None:
    inv = inventory(entries(), read)
    assert inv["file:requirements.txt"] == "a" * 64
    assert {k for k in inv if k.startswith("file:")} == {
        "file:requirements.txt",
        "file:requirements-dev.txt",
        "file:pyproject.toml",
        "file:uv.lock",
        "file:poetry.lock",
        "file:package.json",
        "file:package-lock.json",
    }
    assert inv["pypi:.venv/lib/python3.11/site-packages:requests"] == "2.32.0"
    assert inv["npm:node_modules:left-pad"] == "1.3.0"
    assert inv["npm:node_modules:@types/node"] == "20.1.0"
    assert inv["npm:app/node_modules:x"] == "?"  # unreadable version: listed, not trusted
    assert not any("notes" in k or "lib/package.json" in k for k in inv)


def test_diff_names_what_a_run_installed_upgraded_and_removed() -> None:
    old = inventory(entries(), read)
    new_entries = entries(
        **{"requirements.txt": f("9" * 64), ".venv/lib/python3.11/site-packages/evil_pkg-0.1.dist-info": D}
    )
    del new_entries["node_modules/left-pad/package.json"]
    change = inventory_diff(old, inventory(new_entries, read))
    assert change["added"] == {"pypi:.venv/lib/python3.11/site-packages:evil-pkg": "0.1"}
    assert change["removed"] == {"npm:node_modules:left-pad": "1.3.0"}
    assert change["changed"] == {"file:requirements.txt": ["a" * 64, "9" * 64]}
    s = summary(change)
    assert s["added_count"] == 1 and s["added"] == ["pypi:.venv/lib/python3.11/site-packages:evil-pkg"]


def test_positive_control_nothing_changed_nothing_reported() -> None:
    inv = inventory(entries(), read)
    assert inventory_diff(inv, inv) == {"added": {}, "removed": {}, "changed": {}}
    assert summary(inventory_diff(inv, inv)) == {"added_count": 0, "removed_count": 0, "changed_count": 0}
