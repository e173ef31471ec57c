"""Escape-aware matching of one secret: every character may appear in any encoding a decoder undoes.

Why not a list of whole-value encodings (redact.py `encodings`): an upstream that reflects the credential
may escape *any subset* of its characters — JSON `s\\u0065cret`, a partly percent-encoded `s%65cret`,
HTML `s&#101;cret` — and the sandbox recovers the secret by decoding the body. No fixed pattern matches
such a mixed form, so the secret is matched as a sequence where each character is one of:

- its UTF-8 bytes, each byte literal or `%XX` (either hex case): URL decoders decode byte-wise;
  `+` for a space (form encoding); `%uXXXX` and, for U+0080..U+00FF, `%XX` of the code point
  (JavaScript `escape()` / `unescape()`);
- JSON / JavaScript string escapes: `\\uXXXX` (either hex case; a surrogate pair beyond the BMP), the
  short escapes `\\" \\\\ \\/ \\b \\f \\n \\r \\t`, `\\xHH` and `\\u{H...}`;
- HTML character references: `&#D;`, `&#xH;`, `&#XH;` with leading zeros up to MAX_REF_DIGITS digits,
  the `;` optional (HTML decodes a numeric reference without it; the lookahead makes sure a decoder
  would stop there: `&#1011` is not `e1`), the windows-1252 remapping of `&#128;`..`&#159;`, and the
  named references of `html.entities.html5` (with their legacy `;`-less forms).

Bounded on purpose: every alternative has a fixed maximal length, so a match has one too (`max_len`,
plus one byte of lookahead). StreamScrubber keeps that many bytes back, which is what catches a mixed
form split across chunks. A reference padded beyond MAX_REF_DIGITS digits is not matched (docs/operations.md).

`triggers` are the first bytes of every non-literal alternative: a match that is not the raw value
contains at least one of them. Scrubber uses that for its fast path.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from html.entities import html5

MAX_REF_DIGITS = 8  # digits of a numeric reference / \u{...}, leading zeros included
_JSON_SHORT = {'"': b'\\"', "\\": b"\\\\", "/": b"\\/", "\b": b"\\b", "\f": b"\\f", "\n": b"\\n",
               "\r": b"\\r", "\t": b"\\t"}
_NAMED: dict[str, list[str]] = {}
for _name, _char in html5.items():
    if len(_char) == 1:
        _NAMED.setdefault(_char, []).append(_name)
# HTML decodes &#128;..&#159; as windows-1252 (&#128; is the euro sign); the stdlib decoder is the reference.
_CP1252 = {html.unescape(f"&#{n};"): n for n in range(0x80, 0xA0) if html.unescape(f"&#{n};") != chr(n)}


@dataclass(frozen=True, slots=True)
class EscapedPattern:
    """Regex source matching `value` with any subset of its characters escaped."""

    source: bytes
    # Longest match, + 1: the byte a `;`-less reference's lookahead reads. (The `;` counted in that
    # reference's own maximum covers it already; the + 1 keeps the window sound regardless.)
    max_len: int
    triggers: frozenset[int]  # first byte of every non-literal alternative


def _hex(value: int, width: int = 0) -> bytes:
    """`value` in hex, each letter digit accepting either case (`6[bB]`)."""
    out = b""
    for d in format(value, f"0{width}x").encode():
        out += b"[%c%c]" % (d, d - 32) if d >= ord("a") else bytes([d])
    return out


def _padded(digits: bytes, pattern: bytes | None = None) -> tuple[bytes, int]:
    """Leading zeros so that the reference has at most MAX_REF_DIGITS digits: (regex, max length)."""
    zeros = max(MAX_REF_DIGITS - len(digits), 0)
    return b"0{0,%d}" % zeros + (pattern or digits), zeros + len(digits)


def _utf16(cp: int) -> list[int]:
    if cp < 0x10000:
        return [cp]
    cp -= 0x10000
    return [0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF)]


def _char_alternatives(char: str) -> list[tuple[bytes, int, bytes]]:
    """(regex, max length, first byte) of every encoding of `char`; the literal one first, then the
    escapes (each begins with its first byte, the trigger)."""
    cp = ord(char)
    raw = char.encode("utf-8")
    pct = [b"(?:%s|%%%s)" % (re.escape(bytes([b])), _hex(b, 2)) for b in raw[1:]]
    alts = [(re.escape(raw[:1]) + b"".join(pct), 1 + 3 * (len(raw) - 1), raw[:1]),
            (b"%" + _hex(raw[0], 2) + b"".join(pct), 3 * len(raw), b"%")]
    if char == " ":
        alts.append((b"\\+", 1, b"+"))
    units = _utf16(cp)
    alts.append((b"".join(b"%u" + _hex(u, 4) for u in units), 6 * len(units), b"%"))
    alts.append((b"".join(b"\\\\u" + _hex(u, 4) for u in units), 6 * len(units), b"\\"))
    if 0x80 <= cp <= 0xFF:
        alts.append((b"%" + _hex(cp, 2), 3, b"%"))
    if cp <= 0xFF:
        alts.append((b"\\\\x" + _hex(cp, 2), 4, b"\\"))
    if char in _JSON_SHORT:
        alts.append((re.escape(_JSON_SHORT[char]), 2, b"\\"))
    brace, n = _padded(format(cp, "x").encode(), _hex(cp))
    alts.append((b"\\\\u\\{" + brace + b"\\}", 4 + n, b"\\"))
    for code in [cp] + ([_CP1252[char]] if char in _CP1252 else []):
        dec, n = _padded(str(code).encode())
        alts.append((b"&\\#" + dec + b"(?:;|(?![0-9]))", 3 + n, b"&"))
        hexa, n = _padded(format(code, "x").encode(), _hex(code))
        alts.append((b"&\\#[xX]" + hexa + b"(?:;|(?![0-9a-fA-F]))", 4 + n, b"&"))
    for name in sorted(_NAMED.get(char, ()), key=len, reverse=True):  # `amp;` before `amp`
        alts.append((b"&" + re.escape(name.encode("ascii")), 1 + len(name), b"&"))
    return alts


def escaped_pattern(value: str) -> EscapedPattern:
    """The escape-aware pattern of `value` (non-empty). The first character's alternatives form the
    first group, so sre keeps its first-character skip (a charset of their first bytes)."""
    if not value:
        raise ValueError("cannot match an empty value")
    parts: list[bytes] = []
    total = 0
    triggers: set[int] = set()
    for char in value:
        alts = _char_alternatives(char)
        # The literal last: `&` must not win over `&amp;` (the longest encoding is the one redacted).
        parts.append(b"(?:" + b"|".join(a for a, _, _ in alts[1:] + alts[:1]) + b")")
        total += max(n for _, n, _ in alts)
        triggers.update(first[0] for _, _, first in alts[1:])
        if len(char.encode("utf-8")) > 1:
            triggers.add(ord("%"))  # a later byte of the literal alternative may be %XX
    return EscapedPattern(b"".join(parts), total + 1, frozenset(triggers))


def _trie(words: set[str]) -> bytes:
    """A regex matching exactly `words` (lowercase hex/decimal/names), shaped as a trie so sre tests
    one byte per branch; hex letters accept either case (names are case-sensitive: no letters a-f
    folded there, see `_names`)."""
    tree: dict = {}
    for word in words:
        node = tree
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict) -> bytes:
        alts = []
        for ch, child in sorted(node.items(), key=lambda kv: kv[0] == ""):  # the end marker last
            if ch == "":
                alts.append(b"")
            elif ch in "abcdef":
                alts.append(b"[%c%c]" % (ord(ch), ord(ch.upper())) + emit(child))
            else:
                alts.append(re.escape(ch.encode("ascii")) + emit(child))
        return alts[0] if len(alts) == 1 else b"(?:" + b"|".join(alts) + b")"

    return emit(tree) if tree else b"(?!)"


def escape_prefilter(values: list[str]) -> tuple[list[bytes], list[bytes]]:
    """(needles, regex sources) that together find (at least a prefix of) every escape alternative of
    every character of `values` — and little else: innocent `%20`, `\\n`, `&amp;` are not found unless
    a secret holds that character. A match that is not the raw value contains one such escape, so
    Scrubber runs the full escape-aware regexes only on data where one of these finds something.
    Each regex starts with a fixed prefix (`%`, `\\u`, `\\x`, `&#`): sre then skips with a literal
    search instead of testing a character set at every byte, which is what makes this cheaper than
    the full regex on JSON or HTML full of escapes."""
    chars = {c for v in values for c in v}
    pct, units, x2, hexa, dec = set(), set(), set(), set(), set()
    needles: set[bytes] = set()
    for c in chars:
        cp = ord(c)
        pct.update(format(b, "02x") for b in c.encode("utf-8"))  # continuation bytes too
        units.add(format(_utf16(cp)[0], "04x"))
        hexa.add(format(cp, "x"))
        dec.add(str(cp))
        if cp <= 0xFF:
            x2.add(format(cp, "02x"))
            if cp >= 0x80:
                pct.add(format(cp, "02x"))
        if c in _CP1252:
            hexa.add(format(_CP1252[c], "x"))
            dec.add(str(_CP1252[c]))
        if c in _JSON_SHORT:
            needles.add(_JSON_SHORT[c])
        if c == " ":
            needles.add(b"+")
        needles.update(b"&" + n.encode("ascii") for n in _NAMED.get(c, ()))
    regexes = [b"%(?:" + _trie(pct) + b"|u" + _trie(units) + b")",
               b"\\\\u(?:" + _trie(units) + b"|\\{0*" + _trie(hexa) + b"\\})",
               b"&\\#(?:0*" + _trie(dec) + b"|[xX]0*" + _trie(hexa) + b")"]
    if x2:
        regexes.append(b"\\\\x" + _trie(x2))
    return sorted(needles), regexes


def escaped_any(chars: str) -> EscapedPattern:
    """One character that is any of `chars`, each in any of its encodings (the per-character
    alternatives of `escaped_pattern`, unioned). For tokens known by shape, not by value (the broker's
    phantoms: `egph_` + hex): the gateway stores only their hash, so it matches the class and decodes
    the match (`decode_escaped`) to hash it. Escapes first, literals last, as in `escaped_pattern`."""
    if not chars:
        raise ValueError("cannot match an empty class")
    escapes: list[bytes] = []
    literals: list[bytes] = []
    longest = 0
    triggers: set[int] = set()
    for char in dict.fromkeys(chars):
        alts = _char_alternatives(char)
        literals.append(alts[0][0])
        escapes += [a for a, _, _ in alts[1:]]
        longest = max(longest, *(n for _, n, _ in alts))
        triggers.update(first[0] for _, _, first in alts[1:])
    return EscapedPattern(b"(?:" + b"|".join(escapes + literals) + b")", longest, frozenset(triggers))


_SINGLE: dict[str, re.Pattern[bytes]] = {}


def decode_escaped(data: bytes, chars: str) -> str | None:
    """The characters a decoder reads from `data` when every character is one of `chars` in any
    encoding (the inverse of `escaped_any`, by the same alternatives); None when `data` is not such a
    sequence. Used on a match only (short), so trying each character's alternatives in turn is cheap."""
    out: list[str] = []
    pos = 0
    while pos < len(data):
        for char in chars:
            regex = _SINGLE.get(char)
            if regex is None:
                alts = _char_alternatives(char)
                regex = _SINGLE[char] = re.compile(b"(?:" + b"|".join(a for a, _, _ in alts[1:] + alts[:1]) + b")")
            m = regex.match(data, pos)
            if m is not None and m.end() > pos:
                out.append(char)
                pos = m.end()
                break
        else:
            return None
    return "".join(out)
