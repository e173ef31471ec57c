"""An independent leak oracle: does `out` carry `secret` in any encoding a scrubber must catch?

Independent of the scrubber's own pattern list on purpose (a shared list would make a missed encoding
invisible to the tests): it decodes what came out (base64 runs at every alignment, percent-decoding,
JSON unescaping) and looks for the secret; `decoded_leaks` decodes mixed escapes (JSON, HTML, percent,
alone and chained), as a sandbox decoding the body would.
"""

from __future__ import annotations

import base64
import html
import itertools
import json
import re
from urllib.parse import unquote, unquote_plus

_B64_RUN = re.compile(rb"[A-Za-z0-9+/_\-]{4,}={0,2}")


def leaks(out: bytes, secret: str) -> list[str]:
    raw = secret.encode()
    found = []
    if raw in out:
        found.append("raw")
    text = out.decode("utf-8", "replace")
    if secret in unquote(text) or secret in unquote_plus(text):
        found.append("url")
    for esc in (json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]):
        if esc.encode() in out or esc.replace("/", "\\/").encode() in out:
            found.append("json")
    for m in _B64_RUN.finditer(out):
        run = m.group(0).rstrip(b"=").replace(b"-", b"+").replace(b"_", b"/")
        for off in range(4):
            part = run[off:]
            if len(part) % 4 == 1:
                part = part[:-1]
            part += b"=" * (-len(part) % 4)
            try:
                if raw in base64.b64decode(part):
                    found.append("base64")
            except ValueError:
                pass
    return found + decoded_leaks(out, secret)


_JS_ESCAPE = re.compile(r'\\(u\{[0-9a-fA-F]{1,8}\}|u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|["\\/bfnrt])')
_JS_SHORT = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_PCT_U = re.compile(r"%u([0-9a-fA-F]{4})")


def _surrogates(text: str) -> str:
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _json_unescape(text: str) -> str:
    """JSON / JavaScript string escapes, decoded wherever they occur (a body is rarely one string)."""
    def one(m: re.Match) -> str:
        e = m.group(1)
        if e.startswith("u{"):
            return chr(int(e[2:-1], 16))
        if len(e) > 1:
            return chr(int(e[1:], 16))
        return _JS_SHORT.get(e, e)
    return _surrogates(_JS_ESCAPE.sub(one, text))


def _pct_unescape(text: str) -> str:
    """WHATWG percent-decoding (UTF-8) plus JavaScript unescape()'s %uXXXX."""
    return unquote(_surrogates(_PCT_U.sub(lambda m: chr(int(m.group(1), 16)), text)))


def decoded_leaks(out: bytes, secret: str) -> list[str]:
    """The decodings a sandbox may apply to a body with mixed escapes: each alone, and chained in
    every order (a character escaped one way next to one escaped another)."""
    text = out.decode("utf-8", "replace")
    decoders = {"json": _json_unescape, "html": html.unescape, "url": _pct_unescape,
                "form": lambda t: _pct_unescape(t.replace("+", " "))}
    found = [name for name, dec in decoders.items() if secret in dec(text)]
    orders = [*itertools.permutations(("json", "html", "url")), *itertools.permutations(("json", "html", "form"))]
    for order in orders:
        t = text
        for name in order:
            t = decoders[name](t)
        if secret in t:
            found.append("+".join(order))
    return found
