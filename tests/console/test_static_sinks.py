"""The console's static files: no HTML/code sinks, no inline script, style or handlers, nothing remote,
every file shipped as package data, and dom.js's attribute allowlist free of handlers and URLs.

Positive control: the same scanner finds each forbidden construct when planted in a copy.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from tests.console.static_scan import STATIC, scan

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_static_files_have_no_forbidden_sinks() -> None:
    files = sorted(p.name for p in STATIC.iterdir())
    assert {"index.html", "app.js", "app.css", "dom.js"} <= set(files), files
    assert scan(STATIC) == []


PLANTED = [
    ("app.js", "node.innerHTML = rec.host;", "innerHTML"),
    ("app.js", "x.insertAdjacentHTML('beforeend', s);", "insertAdjacentHTML"),
    ("app.js", "document.write(s);", "document.write"),
    ("app.js", "eval(s);", "eval"),
    ("app.js", "const f = new Function('return 1');", "Function constructor"),
    ("app.js", "setTimeout('alert(1)', 1);", "string timer"),
    ("app.js", "btn.onclick = go;", "on* property handler"),
    ("app.js", "n.setAttribute('onerror', s);", "on* attribute"),
    ("app.js", "n.setAttribute(\"style\", s);", "style attribute"),
    ("app.js", "a.setAttribute('href', rec.url);", "href/src attribute"),
    ("app.js", "a.href = rec.url;", "URL property assigned outside the blob link"),
    ("app.js", "import x from 'https://cdn.example/x.js';", "remote module"),
    ("app.js", "location.href = rec.url;", "location assignment"),
    ("index.html", "<script>alert(1)</script>", "inline script"),
    ("index.html", "<img src=\"/ui/static/x.png\" onerror=\"alert(1)\">", "inline handler"),
    ("index.html", "<div style=\"color:red\"></div>", "style attribute"),
    ("index.html", "<script src=\"https://cdn.example/x.js\"></script>", "remote resource"),
    ("index.html", "<link rel=\"stylesheet\" href=\"//cdn.example/x.css\">", "remote resource"),
    ("app.css", "@import url(https://cdn.example/x.css);", "@import"),
    ("app.css", "body { background: url(https://x.example/a.png); }", "url()"),
]


@pytest.mark.parametrize(("name", "line", "what"), PLANTED, ids=[p[2] + ":" + p[1][:20] for p in PLANTED])
def test_scanner_finds_planted_sink(tmp_path: Path, name: str, line: str, what: str) -> None:
    copy = tmp_path / "static"
    shutil.copytree(STATIC, copy)
    assert scan(copy) == []  # the copy is clean, so what is found below is what was planted
    target = copy / name
    target.write_text(target.read_text() + "\n" + line + "\n")
    found = scan(copy)
    assert any(f.endswith(what) for f in found), found


def test_comments_naming_sinks_are_not_findings(tmp_path: Path) -> None:
    copy = tmp_path / "static"
    shutil.copytree(STATIC, copy)
    (copy / "app.js").write_text((copy / "app.js").read_text() + "\n// never innerHTML or eval(x)\n")
    assert scan(copy) == []


def test_dom_attribute_allowlist_has_no_handler_style_or_url() -> None:
    text = (STATIC / "dom.js").read_text()
    for name in ("SAFE_ATTRS", "SVG_ATTRS"):
        block = re.search(name + r" = new Set\(\[(.*?)\]\)", text, re.S)
        assert block, name
        attrs = set(re.findall(r"\"([^\"]+)\"", block.group(1)))
        assert attrs, name
        bad = {a for a in attrs if a.startswith("on") or a in {"style", "href", "src", "xlink:href", "action",
                                                                   "formaction", "srcdoc", "srcset"}}
        assert not bad, (name, bad)


def test_every_static_file_is_package_data() -> None:
    """pyproject ships them: each file matches a package-data pattern of the egressgate.admin.ui package."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = conf["tool"]["setuptools"]["package-data"]["egressgate.admin.ui"]
    for path in STATIC.iterdir():
        rel = f"static/{path.name}"
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), (rel, patterns)
    dev = conf["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("playwright") for d in dev), dev
