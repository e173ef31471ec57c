"""docs/architecture.md's hook x addon table is the one description of the pipeline: it must match
the addons master.py adds (same order) and the hooks each of them really implements."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from mitmproxy import hooks
from mitmproxy.addons import tlsconfig

import egressgate.gateway.master  # noqa: F401  (registers the gateway's own hooks: ws_layer, passthrough, ...)

ROOT = Path(__file__).resolve().parents[2]


def _table() -> list[tuple[str, str, list[str]]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- hook-table:start -->", 1)[1].split("<!-- hook-table:end -->", 1)[0]
    rows = []
    for line in block.splitlines():
        m = re.match(r"\| \d+ \| (\w+) \((?:`([\w/]+)\.py`|mitmproxy)\) \| ([\w, ]+) \|$", line)
        if m:
            rows.append((m.group(1), m.group(2) or "", [h.strip() for h in m.group(3).split(",")]))
    return rows


def _master_order() -> list[str]:
    """Class names in the `ours = [...]` list of GatewayMaster.start, in order."""
    tree = ast.parse((ROOT / "egressgate" / "gateway" / "master.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ours":
            names = []
            for elt in node.value.elts:  # type: ignore[attr-defined]
                if isinstance(elt, ast.Call):
                    names.append(elt.func.attr if isinstance(elt.func, ast.Attribute) else elt.func.id)
                else:  # a name bound earlier (record = Record(rt))
                    names.append(elt.id.capitalize())
            return names
    raise AssertionError("no `ours = [...]` in master.py")


def test_the_table_lists_master_py_addons_in_order() -> None:
    assert [name for name, _module, _hooks in _table()] == _master_order()


def test_the_table_lists_each_addons_hooks() -> None:
    known = set(hooks.all_hooks)
    for name, module, listed in _table():
        cls = tlsconfig.TlsConfig if not module else getattr(
            importlib.import_module(f"egressgate.gateway.{module.replace('/', '.')}"), name)
        implemented = sorted(h for h in dir(cls) if h in known)
        assert listed == implemented, (name, listed, implemented)


# The stage words of the one-line pipelines (README's layout table, docs/architecture.md's diagram) -> addon
STAGES = {"identify": "Identity", "consistency": "Consistency", "decide": "DecisionAddon",
          "credentials": "Credentials", "budgets": "Budgets", "record": "Record", "pin": "Pinning",
          "enforce": "Enforce"}


def _stages(line: str) -> list[str]:
    """The addons named by an `a → b → c` pipeline, in its order (words that name no addon are skipped)."""
    out = []
    for step in line.split("→"):
        words = re.findall(r"[a-z]+", step.lower())
        named = [STAGES[w] for w in words if w in STAGES]
        if named:
            out.append(named[0])
    return out


def test_readme_and_architecture_pipelines_follow_master_py() -> None:
    """README's one-line pipeline and the diagram atop docs/architecture.md name the request stages in the
    order master.py runs them (they once disagreed: README had pin before inject and record last)."""
    order = _master_order()
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"one addon per stage[^(]*\(([^;]*);", readme)
    assert line, "README's gateway row lost its pipeline"
    diagram = (ROOT / "docs" / "architecture.md").read_text().split("```", 2)[1]
    request_part = diagram.split("…", 1)[0]
    for name, text in (("README.md", line.group(1)), ("docs/architecture.md", request_part)):
        stages = _stages(text)
        assert len(stages) >= 6, (name, stages)
        assert stages == sorted(stages, key=order.index), (name, stages, order)


def _diagram_lines() -> list[tuple[str, list[str]]]:
    """(hook, addons named on its line, in the line's order) for every `hook: ...` line of the path diagrams."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- path-diagrams:start -->", 1)[1].split("<!-- path-diagrams:end -->", 1)[0]
    addons = set(_master_order())
    out = []
    for line in block.splitlines():
        m = re.match(r"(\w+): (.*)$", line)
        if m and m.group(1) in hooks.all_hooks:
            named = [w for w in re.findall(r"\b[A-Z]\w+\b", m.group(2)) if w in addons]
            out.append((m.group(1), list(dict.fromkeys(named))))
    return out


def test_path_diagrams_name_addons_that_run_that_hook_in_master_order() -> None:
    """docs/architecture.md draws one diagram per path (plain HTTP, CONNECT intercepted, passthrough,
    WebSocket, raw TCP, transparent, DNS, MCP); on every `hook:` line the addons it names implement that
    hook and appear in the order master.py runs them."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- path-diagrams:start -->", 1)[1].split("<!-- path-diagrams:end -->", 1)[0]
    assert block.count("```") >= 16, "one fenced diagram per path (8 paths)"
    classes = {name: tlsconfig.TlsConfig if not module else getattr(
        importlib.import_module(f"egressgate.gateway.{module.replace('/', '.')}"), name)
        for name, module, _hooks in _table()}
    order = _master_order()
    lines = _diagram_lines()
    assert len(lines) >= 25, lines  # not vacuous: the diagrams are read
    for hook, named in lines:
        assert named, f"`{hook}:` line names no addon"
        for name in named:
            assert hasattr(classes[name], hook), f"{name} does not implement {hook}"
        assert named == sorted(named, key=order.index), (hook, named)


def test_every_module_the_architecture_doc_names_exists() -> None:
    """Each `x.py` / `dir/x.py` the page names is a file of the tree: under the repo, egressgate/ or
    egressgate/gateway/, or (a bare name) somewhere under egressgate/. A module moved or renamed without its
    description fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "egressgate"
    bare = {p.name for p in package.rglob("*.py")}
    missing = []
    for mention in sorted(set(re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b", text))):
        if "/" in mention:
            found = any((base / mention).is_file() for base in (ROOT, package, package / "gateway"))
        else:
            found = mention in bare
        if not found:
            missing.append(mention)
    assert not missing, missing
