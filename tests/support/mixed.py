"""A value with *some* of its characters escaped, each in its own way, as a reflecting upstream may
send it (JSON `\\u0065`, `\\/`, partial percent-encoding `s%65cret`, HTML `&#101;` / `&#x65;` ...).

Written from the decoders' specifications (JSON, WHATWG URL / JavaScript, HTML), not from
egressgate/broker/escapes.py, so a form the scrubber forgot is a test failure, not a shared blind spot.
`tests/support/leaks.py` decodes these back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html.entities import html5

_NAMES = {v: k for k, v in sorted(html5.items(), reverse=True) if len(v) == 1 and k.endswith(";")}
_SHORT = {"/": "\\/", '"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _units(c: str) -> list[int]:
    b = c.encode("utf-16-be")
    return [int.from_bytes(b[i:i + 2], "big") for i in range(0, len(b), 2)]


Encoder = Callable[[str], str]
STYLES: dict[str, Encoder] = {
    "lit": lambda c: c,
    "json_lower": lambda c: "".join(f"\\u{u:04x}" for u in _units(c)),
    "json_upper": lambda c: "".join(f"\\u{u:04X}" for u in _units(c)),
    "json_short": lambda c: _SHORT.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c),
    "js_x": lambda c: f"\\x{ord(c):02x}" if ord(c) < 0x100 else c,
    "js_brace": lambda c: f"\\u{{00{ord(c):X}}}",
    "pct_lower": lambda c: "".join(f"%{b:02x}" for b in c.encode()),
    "pct_upper": lambda c: "".join(f"%{b:02X}" for b in c.encode()),
    "pct_u": lambda c: "".join(f"%u{u:04X}" for u in _units(c)),
    "plus": lambda c: "+" if c == " " else f"%{ord(c):02X}" if c.isascii() else c,
    "html_dec": lambda c: f"&#{ord(c)};",
    "html_dec_zeros": lambda c: f"&#{ord(c):07d};",
    "html_hex": lambda c: f"&#x{ord(c):x};",
    "html_HEX": lambda c: f"&#X{ord(c):X};",
    "html_hex_zeros": lambda c: f"&#x{ord(c):06x};",
    "html_named": lambda c: "&" + _NAMES[c] if c in _NAMES else f"&#{ord(c)};",
    "html_nosemi": lambda c: f"&#{ord(c)};",  # the `;` dropped below where HTML still ends the reference
}
JSON = ("lit", "json_lower", "json_upper", "json_short")
HTML = ("lit", "html_dec", "html_hex", "html_HEX", "html_dec_zeros", "html_hex_zeros", "html_nosemi",
        "html_named")
URL = ("lit", "pct_lower", "pct_upper", "plus")
EVERY = tuple(STYLES)


def mixed(value: str, styles: Sequence[str], offset: int = 0) -> str:
    """Character i of `value` in style styles[(i + offset) % len]: every style used, some characters
    literal (but never a bare `\\`, `%`, `&`). A `;`-less numeric reference keeps its `;` when the
    next character is a digit."""
    pieces = []
    for i, c in enumerate(value):
        style = styles[(i + offset) % len(styles)]
        if style == "lit" and c in "\\%&":  # a bare escape introducer would not decode back to itself
            style = styles[(i + offset + 1) % len(styles)]
        pieces.append((STYLES[style](c), style))
    out = []
    for i, (piece, style) in enumerate(pieces):
        nxt = pieces[i + 1][0][:1] if i + 1 < len(pieces) else ""
        if style == "html_nosemi" and not nxt.isdigit():
            piece = piece[:-1]
        out.append(piece)
    return "".join(out)


def mixed_at_random(value: str, choose: Callable[[Sequence[str]], str], styles: Sequence[str] = EVERY) -> str:
    """Each character in a style `choose` picks (hypothesis / random): any subset escaped."""
    return mixed(value, [choose(styles) for _ in value])
