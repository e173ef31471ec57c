"""The gateway's import graph, read from the source (ast, nothing imported): shared by the architecture
tests. Every `import`/`from ... import` of an `egressgate.gateway` module counts, wherever it is written
(inside a function, under `if TYPE_CHECKING:`): a typing-only import is still a dependency a reader has
to follow, and the import circles issue 25 removed were mostly typing-only."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "egressgate.gateway"
PACKAGE_DIR = ROOT / "egressgate" / "gateway"
MASTER = f"{PACKAGE}.master"


@cache
def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the gateway package (subpackages included)."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def module_of(name: str) -> str | None:
    """The gateway module an imported dotted name belongs to (a module, or a name inside one)."""
    mods = modules()
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


@cache
def tree(module: str) -> ast.Module:
    return ast.parse(modules()[module].read_text(), filename=str(modules()[module]))


@cache
def imports(module: str) -> frozenset[str]:
    """The gateway modules `module` imports, directly."""
    out = set()
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith(PACKAGE):
                for alias in node.names:  # `from egressgate.gateway import budgets` imports a module
                    target = module_of(f"{node.module}.{alias.name}") or module_of(node.module)
                    if target is not None:
                        out.add(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = module_of(alias.name) if alias.name.startswith(PACKAGE) else None
                if target is not None:
                    out.add(target)
    out.discard(module)
    out.discard(PACKAGE)  # the package's own __init__ (re-exports nothing the stages need)
    return frozenset(out)


def reach(module: str) -> dict[str, list[str]]:
    """Every gateway module `module` reaches through imports -> one import chain that gets there."""
    paths: dict[str, list[str]] = {}
    todo = [(module, [module])]
    while todo:
        current, path = todo.pop()
        for nxt in sorted(imports(current)):
            if nxt not in paths and nxt != module:
                paths[nxt] = [*path, nxt]
                todo.append((nxt, paths[nxt]))
    return paths


def master_addons() -> list[tuple[str, str]]:
    """(class name, module) of every addon of ours that master.py registers: the names in the
    `ours = [...]` list of GatewayMaster.start (a name bound earlier, like `record = Record(rt)`, is
    followed to its call), each resolved through master.py's own imports. mitmproxy's TlsConfig is left
    out (it is not a module of ours)."""
    master = tree(MASTER)
    imported: dict[str, str] = {}
    for node in ast.walk(master):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            for alias in node.names:
                imported[alias.asname or alias.name] = node.module
    bound: dict[str, ast.expr] = {}
    ours: list[ast.expr] | None = None
    for node in ast.walk(master):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            bound[node.targets[0].id] = node.value
            if node.targets[0].id == "ours":
                ours = node.value.elts  # type: ignore[attr-defined]
    assert ours, "no `ours = [...]` list in master.py"
    out = []
    for elt in ours:
        if isinstance(elt, ast.Name):
            elt = bound[elt.id]
        assert isinstance(elt, ast.Call), ast.unparse(elt)
        func = elt.func
        if isinstance(func, ast.Attribute):  # tlsconfig.TlsConfig(): mitmproxy's own
            continue
        assert isinstance(func, ast.Name) and func.id in imported, f"addon {ast.unparse(elt)} not imported"
        out.append((func.id, imported[func.id]))
    return out
