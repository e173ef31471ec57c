"""Canonical request paths (policy.canon re-exports `canon_path` and `split_path_query`).

* Input is an origin-form request target: it must start with ``/`` (``not_origin_form``; ``*`` and
  absolute-form are the caller's business). The empty path becomes ``/`` (RFC 9110 4.2.3 / RFC 3986
  6.2.3). The query is split off and dropped by :func:`canon_path`; :func:`split_path_query` returns it
  verbatim (without ``?``; ``""`` when absent). A fragment (``#``) is never sent by a conforming client
  and is rejected (``fragment``).
* Percent-encodings of unreserved characters (``A-Z a-z 0-9 - . _ ~``) are decoded (``%41`` -> ``A``,
  ``%2e`` -> ``.``, ``%7E`` -> ``~``); every other escape is kept and upper-cased (``%2f`` -> ``%2F``).
  Malformed escapes are ``bad_percent``; ``%00`` is ``nul``. Nothing is decoded twice (``/a%252eb`` stays).
* ``%2F`` and ``%5C`` stay encoded and are distinct from ``/`` and ``\\`` (RFC 3986: reserved characters'
  escapes are not equivalent to the characters). A raw backslash is rejected (``backslash``): servers
  disagree on whether it separates segments.
* Raw characters that RFC 3986 does not allow in a path (``" < > [ ] ^ ` { | }``) and non-ASCII characters
  (as UTF-8; ``surrogateescape`` recovers raw bytes) are percent-encoded, so ``/a|b`` and ``/a%7Cb`` are
  one path. Controls, NUL/CR/LF, spaces and other whitespace anywhere in the target are rejected
  (``control_char`` / ``whitespace``).
* Dot segments are removed per RFC 3986 5.2.4 *after* that decoding, so ``%2e%2e`` is a dot segment;
  ``..`` above the root clamps at ``/``.
* Consecutive slashes are kept (``/a//b`` stays): matching treats them literally, so a rule for
  ``/a/b`` does not match ``/a//b`` (fails closed). The one place where keeping them is ambiguous is a
  ``..`` that would remove an empty segment: ``/a//../b`` is ``/a/b`` by RFC 3986 but ``/b`` to a
  server that merges slashes before resolving dot segments (nginx by default), so it is rejected
  (``ambiguous_traversal``); so is a ``..`` that would remove a segment hiding an encoded separator or a
  ``;`` (``/admin%2Fx/..`` is ``/`` by RFC 3986 but ``/admin/`` to nginx, which decodes ``%2F`` first).
* Traversal spellings that survive RFC 3986 normalization but that real servers resolve are rejected
  rather than normalized: a dot segment with path parameters (``/..;/admin``, Tomcat-style:
  ``dot_segment_param``); a dot segment that appears once the segment is percent-decoded once or twice
  -- behind an encoded separator or parameter delimiter (``/files/..%2Fadmin``, ``/a/.%5Cb``,
  ``/%2e%2e%3B/x``) or double-encoded (``/%252e%252e/x``) (``encoded_traversal``); and overlong UTF-8
  (``%C0%AE``: ``overlong_utf8``). So are segments that Windows or a Unicode-folding server reads as a
  dot segment: only dots (``...``: ``dot_segment_trailing``), dots and encoded spaces (``..%20``),
  fullwidth or leader dots (``%EF%BC%8E%EF%BC%8E``, ``%E2%80%A5``: ``encoded_traversal``). A ``*`` glob
  segment can therefore never match a segment a server would read as ``..``.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from egressgate.policy.canon_common import MAX_PATH_INPUT, CanonError, reject_controls, require_text, show
from egressgate.policy.readings import fold

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
# pchar minus unreserved and '%', plus '/': characters allowed raw in an RFC 3986 path.
_RAW_OK = _UNRESERVED | frozenset(b"!$&'()*+,;=:@/")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_PLAIN_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/]*", re.ASCII)
_SEPARATORS = re.compile(r"[/\\]")
# Overlong UTF-8 (C0/C1 leads, E0 80-9F, F0 80-8F): never valid, decoded to '.' or '/' by lax decoders.
_OVERLONG = re.compile(r"%C[01]%[89AB][0-9A-F]|%E0%[89][0-9A-F]|%F0%8[0-9A-F]")


def _normalize_escapes(path: str) -> str:
    if _PLAIN_PATH.fullmatch(path):  # the common case: nothing to decode or encode
        return path
    try:
        data = path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise CanonError("bad_char", f"path contains an unencodable character: {show(path)}") from None
    out: list[str] = []
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        if b == 0x25:  # '%'
            if i + 2 >= n:
                raise CanonError("bad_percent", f"truncated percent-escape in path: {show(path)}")
            h1, h2 = data[i + 1], data[i + 2]
            if h1 not in _HEX or h2 not in _HEX:
                raise CanonError("bad_percent", f"malformed percent-escape in path: {show(path)}")
            value = int(bytes((h1, h2)), 16)
            if value == 0:
                raise CanonError("nul", f"path contains an encoded NUL (%00): {show(path)}")
            out.append(chr(value) if value in _UNRESERVED else f"%{value:02X}")
            i += 3
        elif b in _RAW_OK:
            out.append(chr(b))
            i += 1
        else:
            out.append(f"%{b:02X}")
            i += 1
    return "".join(out)


def _is_dot(piece: str) -> bool:
    return piece in (".", "..")


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4 for a path starting with '/': '..' above the root clamps at '/'."""
    if "/." not in path:  # every dot segment follows a '/'
        return path
    segments = path.split("/")[1:]
    out: list[str] = []
    last = len(segments) - 1
    for i, seg in enumerate(segments):
        if seg == ".":
            if i == last:
                out.append("")
        elif seg == "..":
            if out and out[-1] == "":
                # '/a//../b' is '/a/b' by RFC 3986 but '/b' to servers that merge slashes first (nginx).
                raise CanonError("ambiguous_traversal", f"'..' after an empty segment in path: {show(path)}")
            if out and _hides_separator(out[-1]):
                # '/admin%2Fx/..' is '/' by RFC 3986 but '/admin/' to a server that decodes '%2F' first;
                # '/admin;x/../y' is '/y' but '/admin' to one that ignores everything after ';'.
                raise CanonError(
                    "ambiguous_traversal", f"'..' after a segment with an encoded separator or ';': {show(path)}"
                )
            if out:
                out.pop()
            if i == last:
                out.append("")
        else:
            out.append(seg)
    return "/" + "/".join(out)


_SPLITTERS = frozenset("/\\;?#")


def _hides_separator(seg: str) -> bool:
    """Whether some server reads ``seg`` as more than one segment, or as the end of the path: it holds a
    ``;`` (parameters, or the end of the path to some servers), or it does once decoded (once or twice)
    or NFKC-folded: ``/``, ``\\``, ``;``, ``?``, ``#`` (see policy.readings)."""
    if ";" in seg:
        return True
    view = seg
    for _ in range(2):
        if "%" not in view:
            return False
        view = unquote(view, errors="surrogateescape")
        if not view.isascii():
            view = fold(view)
        if not _SPLITTERS.isdisjoint(view):
            return True
    return False


def _dot_after_params(piece: str) -> bool:
    """Whether ``piece`` is a dot segment once path parameters (``;...``) are stripped."""
    return _is_dot(piece.split(";", 1)[0])


def _dot_like(piece: str) -> bool:
    """Whether some server reads ``piece`` as a dot segment: once ``;params`` are stripped, once Windows
    drops trailing dots and spaces (``...``, ``.. ``, ``. .``), or once NFKC-folded (U+FF0E U+FF0E, U+2025)."""
    views = (piece,) if piece.isascii() else (piece, fold(piece))
    for view in views:
        view = view.split(";", 1)[0]
        if _is_dot(view) or ("." in view and view.rstrip(". ") == ""):
            return True
    return False


def _check_hidden_traversal(path: str) -> None:
    """Reject dot segments that only appear to a server that strips parameters or decodes again."""
    if _OVERLONG.search(path):
        raise CanonError("overlong_utf8", f"path contains an overlong UTF-8 encoding: {show(path)}")
    for seg in path.split("/"):
        if _is_dot(seg) or ("%" not in seg and ";" not in seg and not seg.endswith(".")):
            continue
        if _dot_after_params(seg):
            raise CanonError("dot_segment_param", f"dot segment with parameters in path: {show(path)}")
        if _dot_like(seg):
            raise CanonError("dot_segment_trailing", f"segment of dots that Windows reads as '..': {show(path)}")
        view = seg
        for _ in range(2):  # decoded once (%2F, %5C, %3B), decoded twice (%252e...)
            if "%" not in view:
                break
            view = unquote(view, errors="surrogateescape")
            pieces = _SEPARATORS.split(view)
            if not view.isascii():
                pieces += _SEPARATORS.split(fold(view))  # fullwidth / lookalike separators and dots
            if any(_dot_like(piece) for piece in pieces):
                raise CanonError(
                    "encoded_traversal",
                    f"dot segment behind an encoded '/', '\\' or ';', or double-encoded, in path: {show(path)}",
                )


def split_path_query(raw: str) -> tuple[str, str]:
    """Canonical path and the raw query (without '?'; ``""`` when absent) of an origin-form target."""
    raw = require_text(raw, "path")
    if len(raw) > MAX_PATH_INPUT:
        raise CanonError("too_long", f"request target is longer than {MAX_PATH_INPUT} characters")
    reject_controls(raw, "request target")
    if "#" in raw:
        raise CanonError("fragment", f"request target contains a fragment ('#'): {show(raw)}")
    path, _, query = raw.partition("?")
    if path == "":
        path = "/"
    if not path.startswith("/"):
        raise CanonError("not_origin_form", f"path must start with '/': {show(raw)}")
    if "\\" in path:
        raise CanonError("backslash", f"path contains a raw backslash: {show(raw)}")
    normalized = _normalize_escapes(path)
    _check_hidden_traversal(normalized)
    return _remove_dot_segments(normalized), query


def canon_path(raw: str) -> str:
    """Canonical origin-form path (query dropped); see the module docstring for every rule."""
    return split_path_query(raw)[0]
