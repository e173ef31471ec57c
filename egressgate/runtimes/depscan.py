"""`rescan_dependencies`: what a persistent workspace holds in dependency manifests and installed package
trees, and what changed since the last run (issue 22). A package a run installed into the workspace runs
in every later run: a security team wants to see it appear, change and go, not discover it.

Inventory keys (values: a manifest file's sha256, an installed package's version):
* `file:<path>`: requirements*.txt, pyproject.toml, poetry.lock, uv.lock, Pipfile(.lock), setup.cfg,
  package.json, package-lock.json, npm-shrinkwrap.json, yarn.lock, pnpm-lock.yaml — outside installed trees;
* `pypi:<site-packages dir>:<name>`: every `NAME-VERSION.dist-info` / `.egg-info` in a site-packages or
  dist-packages directory;
* `npm:<node_modules dir>:<name>`: every `node_modules/[@scope/]NAME/package.json` (its `version`).

Built from the workspace manifest (runtimes/manifest.py) plus a reader for the package.json files, so the
inventory itself is pure (unit-tested without a file system). Stdlib only.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable

from egressgate.runtimes.manifest import Entry

MANIFEST_NAMES = frozenset(
    {
        "pyproject.toml",
        "poetry.lock",
        "uv.lock",
        "Pipfile",
        "Pipfile.lock",
        "setup.cfg",
        "package.json",
        "package-lock.json",
        "npm-shrinkwrap.json",
        "yarn.lock",
        "pnpm-lock.yaml",
    }
)
MAX_PACKAGE_JSON = 1 << 20
REPORTED = 50  # entries per list in the audit record (the counts are complete)


def _in_installed_tree(parts: list[str]) -> bool:
    return any(p in ("node_modules", "site-packages", "dist-packages") for p in parts[:-1])


def inventory(entries: dict[str, Entry], read: Callable[[str], bytes | None]) -> dict[str, str]:
    """The dependency inventory of a workspace whose manifest is `entries`; `read(path)` returns a file's
    bytes (at most MAX_PACKAGE_JSON) or None."""
    out: dict[str, str] = {}
    for path, entry in entries.items():
        parts = path.split("/")
        name = parts[-1]
        kind = entry.get("t")
        if (
            kind == "f"
            and not _in_installed_tree(parts)
            and (name in MANIFEST_NAMES or fnmatch.fnmatchcase(name, "requirements*.txt"))
        ):
            out[f"file:{path}"] = str(entry.get("sha256"))
        elif (
            kind == "d"
            and len(parts) >= 2
            and parts[-2] in ("site-packages", "dist-packages")
            and (name.endswith(".dist-info") or name.endswith(".egg-info"))
        ):
            stem = name.rsplit(".", 1)[0]
            pkg, _, version = stem.partition("-")
            if pkg and version:
                out[f"pypi:{'/'.join(parts[:-1])}:{pkg.lower().replace('_', '-')}"] = version
        elif kind == "f" and name == "package.json" and len(parts) >= 3:
            holder = parts[-3] if not parts[-3].startswith("@") else (parts[-4] if len(parts) >= 4 else "")
            if holder != "node_modules":
                continue
            pkg = "/".join(parts[-3:-1]) if parts[-3].startswith("@") else parts[-2]
            modules = "/".join([*parts[: -3 if not parts[-3].startswith("@") else -4], "node_modules"])
            version = _version(read(path))
            out[f"npm:{modules}:{pkg}"] = version
    return out


def _version(raw: bytes | None) -> str:
    if raw is None:
        return "?"
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return "?"
    version = doc.get("version") if isinstance(doc, dict) else None
    return version if isinstance(version, str) and len(version) <= 128 else "?"


def inventory_diff(old: dict[str, str], new: dict[str, str]) -> dict[str, dict]:
    """{"added": {key: value}, "removed": {key: value}, "changed": {key: [old, new]}}. Pure."""
    return {
        "added": {k: new[k] for k in sorted(new) if k not in old},
        "removed": {k: old[k] for k in sorted(old) if k not in new},
        "changed": {k: [old[k], new[k]] for k in sorted(new) if k in old and old[k] != new[k]},
    }


def summary(change: dict[str, dict]) -> dict[str, object]:
    """The audit record's form: counts, and at most REPORTED keys of each list."""
    return {f"{what}_count": len(items) for what, items in change.items()} | {
        what: list(items)[:REPORTED] for what, items in change.items() if items
    }
