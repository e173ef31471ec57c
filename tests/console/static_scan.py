"""A scanner for the console's shipped static files: the DOM sinks, inline code and remote loads the
console must never contain (PLAN-14: everything it shows is attacker-influenced, so text only ever
goes in through textContent and the CSP allows only the console's own files).

Kept apart from the test so the positive control can run it over planted bad files.
"""

from __future__ import annotations

import re
from pathlib import Path

STATIC = Path(__file__).resolve().parents[2] / "egressgate" / "admin" / "ui" / "static"

# JS: every way to turn a string into markup or code, to run code from a string, or to point the
# browser at a URL built from data. `.href =` is allowed only on the line marked as the blob link.
JS_FORBIDDEN: dict[str, re.Pattern[str]] = {
    "innerHTML": re.compile(r"\binnerHTML\b"),
    "outerHTML": re.compile(r"\bouterHTML\b"),
    "insertAdjacentHTML": re.compile(r"\binsertAdjacentHTML\b"),
    "document.write": re.compile(r"\bdocument\s*\.\s*write(ln)?\b"),
    "eval": re.compile(r"\beval\s*\("),
    "Function constructor": re.compile(r"\b(new\s+)?Function\s*\("),
    "string timer": re.compile(r"\bset(Timeout|Interval)\s*\(\s*[\"'`]"),
    "createContextualFragment": re.compile(r"\bcreateContextualFragment\b"),
    "DOMParser": re.compile(r"\bDOMParser\b"),
    "setHTML": re.compile(r"\b(setHTMLUnsafe|parseHTMLUnsafe|setHTML)\b"),
    "srcdoc": re.compile(r"\bsrcdoc\b"),
    "javascript: URL": re.compile(r"javascript\s*:", re.I),
    "on* property handler": re.compile(r"\.\s*on[a-z]+\s*=(?!=)"),
    "on* attribute": re.compile(r"setAttribute(NS)?\s*\([^)]*[\"']on[a-z]+[\"']", re.I),
    "style attribute": re.compile(r"setAttribute(NS)?\s*\([^)]*[\"']style[\"']", re.I),
    "href/src attribute": re.compile(r"setAttribute(NS)?\s*\([^)]*[\"'](href|src|xlink:href|action|formaction)[\"']",
                                     re.I),
    "dynamic import": re.compile(r"\bimport\s*\("),
    "remote module": re.compile(r"\bfrom\s*[\"'](?!\./)"),
    "location assignment": re.compile(r"\blocation\s*(\.\s*href)?\s*=(?!=)|\blocation\s*\.\s*(assign|replace)\s*\("),
    "window.open": re.compile(r"\bwindow\s*\.\s*open\s*\("),
}
HREF_ASSIGN = re.compile(r"\.\s*(href|src|action|formAction)\s*=(?!=)")
BLOB_MARK = "// safe-href: blob"

HTML_FORBIDDEN: dict[str, re.Pattern[str]] = {
    "inline script": re.compile(r"<script(?![^>]*\bsrc=)[^>]*>", re.I),
    "inline handler": re.compile(r"\son[a-z]+\s*=", re.I),
    "style attribute": re.compile(r"\sstyle\s*=", re.I),
    "style element": re.compile(r"<style\b", re.I),
    "javascript: URL": re.compile(r"javascript\s*:", re.I),
    "remote resource": re.compile(r"\s(src|href)\s*=\s*[\"']?(https?:)?//", re.I),
    "resource outside /ui/static": re.compile(r"\s(src)\s*=\s*[\"'](?!/ui/static/)", re.I),
    "stylesheet outside /ui/static": re.compile(r"<link\b[^>]*href\s*=\s*[\"'](?!/ui/static/)", re.I),
    "base element": re.compile(r"<base\b", re.I),
    "iframe/object/embed": re.compile(r"<(iframe|object|embed|frame)\b", re.I),
}
CSS_FORBIDDEN: dict[str, re.Pattern[str]] = {
    "@import": re.compile(r"@import", re.I),
    "url()": re.compile(r"\burl\s*\(", re.I),
    "expression()": re.compile(r"expression\s*\(", re.I),
    "behavior": re.compile(r"\bbehavior\s*:", re.I),
}
ALLOWED_SUFFIXES = {".html", ".js", ".css"}


def _strip_js_comments(text: str) -> str:
    """Drop // line comments and /* */ blocks (they may name the sinks they forbid); keeps line numbers."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return "\n".join(re.sub(r"(^|\s)//.*$", "", line) for line in text.split("\n"))


def scan(directory: Path) -> list[str]:
    """Every violation in `directory`, as "file:line: what"."""
    found: list[str] = []
    for path in sorted(directory.iterdir()):
        if path.suffix not in ALLOWED_SUFFIXES:
            found.append(f"{path.name}: not an allowed static file type")
            continue
        raw = path.read_text(encoding="utf-8")
        if path.suffix == ".js":
            rules, text = JS_FORBIDDEN, _strip_js_comments(raw)
            raw_lines = raw.split("\n")
            for n, line in enumerate(text.split("\n"), 1):
                if HREF_ASSIGN.search(line) and BLOB_MARK not in raw_lines[n - 1]:
                    found.append(f"{path.name}:{n}: URL property assigned outside the blob link")
        elif path.suffix == ".html":
            rules, text = HTML_FORBIDDEN, re.sub(r"<!--.*?-->", "", raw, flags=re.S)
        else:
            rules, text = CSS_FORBIDDEN, re.sub(r"/\*.*?\*/", "", raw, flags=re.S)
        for n, line in enumerate(text.split("\n"), 1):
            for what, pattern in rules.items():
                if pattern.search(line):
                    found.append(f"{path.name}:{n}: {what}")
    return found
