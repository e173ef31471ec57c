"""Every third-party module the `egressgate` package imports comes from a declared runtime dependency.

The test environment has the `dev` extra installed, so a module imported from a test-only package (httpx
was, in `sandbox admit`) works here and fails on a plain `pip install egressgate`. This reads the
package's imports with `ast` (function-level and TYPE_CHECKING imports included), finds the
distribution that ships each module, and requires it in `[project].dependencies` (not in an extra).
`scripts/check-bare-install.sh` checks the same end to end, in a venv without the extras.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "egressgate"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(group: str | None = None) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return {normalize(re.match(r"[A-Za-z0-9._-]+", r.strip()).group(0)) for r in reqs}


def _optional(tree: ast.AST) -> set[int]:
    """ids of import nodes inside `try: ... except ImportError` (the code works without the module)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for handler in node.handlers:
            types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught |= {t.id for t in types if isinstance(t, ast.Name)}
        if caught & {"ImportError", "ModuleNotFoundError"}:
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Import | ast.ImportFrom)}
    return out


@cache  # both tests read it (never change it): one parse of ~590 files instead of two (~2 CPU-s)
def imported_modules(include_optional: bool = False) -> dict[str, list[str]]:
    """module name -> files importing it (absolute imports only; relative ones are the package itself).
    Imports guarded by `except ImportError` are left out unless asked for: the package runs without them."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        optional = set() if include_optional else _optional(tree)
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


@cache
def dist_files() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for dist in importlib.metadata.distributions():
        out.setdefault(normalize(dist.metadata["Name"]), set()).update(str(f) for f in dist.files or ())
    return out


@cache
def top_level() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def providers(module: str) -> set[str]:
    """Distributions that ship `module` (namespace packages such as `opentelemetry` span several: the
    one that ships the module's own file is the one that counts)."""
    top = module.split(".")[0]
    candidates = {normalize(d) for d in top_level().get(top, [])}
    rel = module.replace(".", "/")
    exact = {d for d in candidates
             if any(f in (rel + ".py", rel + "/__init__.py") or f.startswith(rel + "/") for f in dist_files()[d])}
    return exact or candidates


def third_party(modules: dict[str, list[str]]) -> dict[str, list[str]]:
    return {m: files for m, files in modules.items()
            if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] not in ("egressgate", "__future__")}


def test_every_third_party_import_is_a_declared_runtime_dependency():
    runtime = declared()
    problems = []
    for module, files in sorted(third_party(imported_modules()).items()):
        dists = providers(module)
        if not dists:
            problems.append(f"{module} (in {files[0]}): no installed distribution ships it")
        elif not dists & runtime:
            problems.append(f"{module} (in {files[0]}): from {sorted(dists)}, not in [project].dependencies")
    assert not problems, "undeclared runtime imports:\n" + "\n".join(problems)


def test_the_scan_sees_what_it_must():
    """Controls: the scan finds function-level imports and maps namespace packages to the right
    distribution, and a test-only package is recognised as not a runtime dependency."""
    modules = imported_modules()
    assert "opentelemetry.sdk._logs" in modules and "mitmproxy" in modules
    assert providers("opentelemetry.sdk._logs") == {"opentelemetry-sdk"}
    exporter = "opentelemetry.exporter.otlp.proto.http._log_exporter"
    assert providers(exporter) == {"opentelemetry-exporter-otlp-proto-http"}
    assert "admin/cli.py" not in str(modules.get("httpx", []))  # sandbox admit: stdlib urllib only
    assert "httpx" in declared("dev") and "httpx" not in declared()
    assert providers("httpx") == {"httpx"}  # so an `import httpx` in the package would be reported
