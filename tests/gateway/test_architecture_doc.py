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
        m = re.match(r"\| \d+ \| (\w+) \((?:`(\w+)\.py`|mitmproxy)\) \| ([\w, ]+) \|$", line)
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
            importlib.import_module(f"egressgate.gateway.{module}"), name)
        implemented = sorted(h for h in dir(cls) if h in known)
        assert listed == implemented, (name, listed, implemented)
