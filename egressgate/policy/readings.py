"""Every plausible server reading of a canonical path, for matching DENY rules fail-closed.

A deny rule protects a resource on someone else's server, and that server -- not egressgate -- decides
which resource a request target names. Servers disagree: nginx merges ``//``, Tomcat and Spring strip
``;params`` from each segment, IIS and Windows fold case and drop trailing dots and spaces, some decode
``%2F``/``%5C`` into separators or decode twice, Windows treats ``\\`` (and, through best-fit code
pages, ``¥``/``₩``) as a separator, and Unicode-aware stacks NFKC-fold fullwidth U+FF0F and U+FF21. So a
deny rule is matched against the closure of these readings of the canonical path (each transform applied
to each reading, in every order), never against the canonical path alone. Allow rules never see these
readings: they match the canonical path only, so nothing here can widen what a policy opens.

Readings live in "reading space": percent-decoded or not, folded or not -- the deny glob's own literal
text is decoded and folded the same way (:func:`fold`), see ``globs.DenyGlob``.

Also modelled: Spring's trailing-slash and suffix-pattern matching (``/admin/`` and ``/admin.json`` serve
``/admin``), IIS's NTFS stream suffix (``/secret.txt::$DATA``), a decoded ``?``/``#`` re-read as a
delimiter, and ``;`` ending the whole path.

What cannot be modelled is refused (:class:`AmbiguousPath`), but only on hosts that have path-scoped deny
rules (the caller asks for readings only then): bytes that are not UTF-8 once decoded (a server may read
them as Latin-1, a code page or best-fit ASCII), control characters or NUL once decoded (C servers
truncate at NUL, others strip tabs), Windows 8.3 short names (``ADMINI~1`` names a long name we cannot
know), a non-plain path longer than :data:`MAX_READ_PATH`, and more than :data:`MAX_READINGS` readings.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import unquote_to_bytes

MAX_READINGS = 64
"""More distinct readings than this is an encoding puzzle, not a request: refused as ambiguous."""
MAX_READ_PATH = 2048
"""Longest non-plain path whose readings are computed (bounds the CPU one request can cost)."""


class AmbiguousPath(Exception):
    """The path has a server reading egressgate cannot model. ``code`` is a stable identifier."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# Characters that best-fit code pages (cp932 / cp949: 0x5C is shown as ¥ / ₩) or lookalike-folding
# stacks turn into separators, and that NFKC leaves alone.
_LOOKALIKES = str.maketrans({
    "\u2215": "/",  # DIVISION SLASH
    "\u2044": "/",  # FRACTION SLASH
    "\u29f8": "/",  # BIG SOLIDUS
    "\u2216": "\\",  # SET MINUS
    "\u29f9": "\\",  # BIG REVERSE SOLIDUS
    "\u00a5": "\\",  # YEN SIGN (cp932 best fit -> 0x5C)
    "\u20a9": "\\",  # WON SIGN (cp949 best fit -> 0x5C)
})
# After decoding: C0 controls (NUL included), DEL, C1 controls.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_ENCODED_SEPARATOR = re.compile("(%2[fF]|%5[cC])")
_PARAMS = re.compile(r";[^/]*")
_ADS = re.compile(r"::\$data(?=/|$)")
# A Windows 8.3 short name (``ADMINI~1``, ``SECRET~2.TXT``) names a long name we cannot know.
_SHORT_NAME = re.compile(r"(?:^|/)[^/~]{1,6}~[0-9]{1,6}(?:\.[^/.]{0,3})?(?=/|$)")
_SLASHES = re.compile(r"/{2,}")
_TRAILING = re.compile(r"[. ](?:/|$)")
# Canonical paths whose every reading is the path itself: nothing to decode, fold, strip or merge.
# (lower case, no escapes, no ';', no '~', no '//', no trailing '/' or dots, no extension on the last segment)
_PLAIN = re.compile(r"(?:/[a-z0-9_-]+(?:\.[a-z0-9_-]+)*)*/[a-z0-9_-]+|/", re.ASCII)


def fold(text: str) -> str:
    """Case and compatibility folding as a case-insensitive, Unicode-normalizing server would read it:
    NFKC (fullwidth U+FF21 -> ``A``, U+FF0F -> ``/``, long s U+017F -> ``s``), lookalike separators, upper-then-lower
    (dotless U+0131 -> ``i``, ``ß`` -> ``ss``), then combining marks dropped (best-fit ``é`` -> ``e``)."""
    if text.isascii():
        return text.lower()
    text = unicodedata.normalize("NFKC", text).translate(_LOOKALIKES).upper().lower()
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))


def _decode(text: str, what: str) -> str:
    try:
        out = unquote_to_bytes(text).decode("utf-8")
    except UnicodeDecodeError:
        raise AmbiguousPath("invalid_utf8", f"{what} is not UTF-8 once percent-decoded") from None
    if _CONTROL.search(out):
        raise AmbiguousPath("control_char", f"{what} contains a control character or NUL once decoded")
    return out


def _decode_keep_separators(text: str) -> str:
    """One round of decoding that keeps ``%2F``/``%5C`` as data (Apache ``AllowEncodedSlashes NoDecode``)."""
    return _decode(_ENCODED_SEPARATOR.sub(_escape_percent, text), "path")  # %2F -> %252F -> decoded: %2F


def _escape_percent(match: re.Match[str]) -> str:
    return "%25" + match.group()[1:]


def _remove_dots(path: str) -> str:
    """RFC 3986 5.2.4 (``..`` above the root clamps), on a reading that may have gained dot segments."""
    out: list[str] = []
    segments = path.split("/")[1:]
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == ".":
            if last:
                out.append("")
        elif seg == "..":
            if out:
                out.pop()
            if last:
                out.append("")
        else:
            out.append(seg)
    return "/" + "/".join(out)


def _strip_trailing(path: str) -> tuple[str, ...]:
    """Windows: trailing dots and spaces of a segment are dropped (``admin.`` and ``admin `` are
    ``admin``). A segment of only dots and spaces has no agreed reading: both ``.`` and ``..``."""
    if not _TRAILING.search(path):
        return ()
    segments = path.split("/")
    if not any(s.endswith((".", " ")) and s not in (".", "..") for s in segments):
        return ()
    variants = []
    for empty in (".", ".."):
        out = []
        for seg in segments:
            if seg in (".", "..") or not seg.endswith((".", " ")):
                out.append(seg)
            else:
                out.append(seg.rstrip(". ") or empty)
        variants.append("/".join(out))
    return tuple(variants)


def _normalize(r: str) -> str:
    """What every reading also gets: folding, ``\\`` as a separator, merged slashes, resolved dot segments.

    Applying these always (instead of as choices) keeps the set small. The readings they skip -- a
    fullwidth U+FF0F or a ``\\`` kept as data, an unmerged ``//`` -- only matter to a wildcard segment,
    and the canonical path is matched too, with wildcards that cross encoded separators."""
    r = fold_separators(r)
    return _remove_dots(r) if "/." in r else r


def fold_separators(text: str) -> str:
    """Folded, ``\\`` read as ``/``, slashes merged: the part of :func:`_normalize` that a deny glob's
    literal text gets too (globs.deny_glob), so rule text and readings meet in the same space."""
    text = fold(text).replace("\\", "/")
    return _SLASHES.sub("/", text) if "//" in text else text


def _transforms(r: str) -> tuple[str, ...]:
    """The readings on which servers disagree, one step each; the closure combines them in any order."""
    out: list[str] = []
    if "%" in r:
        out.append(_decode(r, "path"))
        if _ENCODED_SEPARATOR.search(r):
            out.append(_decode_keep_separators(r))
    if ";" in r:
        out.append(_PARAMS.sub("", r))  # Tomcat/Spring: ;params stripped from every segment
        out.append(r.split(";", 1)[0] or "/")  # everything after the first ';' ignored
    if "?" in r or "#" in r:  # a decoded %3F / %23 re-read as a query / fragment delimiter
        out.append(re.split("[?#]", r, maxsplit=1)[0] or "/")
    out.extend(_strip_trailing(r))
    if "::$data" in r:  # NTFS default stream: IIS serves /secret.txt::$DATA as /secret.txt
        out.append(_ADS.sub("", r))
    if len(r) > 1 and r.endswith("/"):  # Spring trailing-slash match: /admin/ is /admin
        out.append(r.rstrip("/") or "/")
    last = r.rsplit("/", 1)[1]
    if "." in last[1:]:  # Spring suffix-pattern match: /admin.json is /admin
        out.append(r[: len(r) - len(last)] + last.split(".", 1)[0])
    return tuple(_normalize(x) for x in out)


def server_readings(path: str) -> frozenset[str]:
    """The canonical ``path`` and every reading the transforms above produce from it, in any order.

    Raises :class:`AmbiguousPath` when a reading cannot be modelled or there are too many of them."""
    if _PLAIN.fullmatch(path):
        return frozenset((path,))
    if len(path) > MAX_READ_PATH:
        raise AmbiguousPath("too_long", f"path is longer than {MAX_READ_PATH} characters and not plain")
    if _SHORT_NAME.search(path):
        raise AmbiguousPath("short_name", "path has a Windows 8.3 short-name segment (e.g. ADMINI~1)")
    seen = {path, _normalize(path)}
    work = list(seen)
    while work:
        for reading in _transforms(work.pop()):
            if reading not in seen:
                if _SHORT_NAME.search(reading):
                    raise AmbiguousPath("short_name", "path has a Windows 8.3 short-name segment (e.g. ADMINI~1)")
                if len(seen) >= MAX_READINGS:
                    raise AmbiguousPath("too_many_readings", f"path has more than {MAX_READINGS} server readings")
                seen.add(reading)
                work.append(reading)
    return frozenset(seen)
