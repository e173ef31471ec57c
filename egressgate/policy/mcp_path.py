"""Plain canonical file paths for `path_prefix` argument checks.

A tool receives the argument as a string and hands it to some file API we cannot see: it may resolve
`..`, merge `//`, percent-decode, treat `\\` as a separator, stop at NUL or fold Unicode look-alikes
(U+2025 TWO DOT LEADER is `..` after NFKC). So nothing is normalized here: a path is accepted only when
every such reading gives the same path, i.e. it is absolute and contains none of those spellings, and
the prefix check is then a plain segment-wise comparison. Refusing is cheap; guessing the tool's reading
is a traversal.
"""

from __future__ import annotations

import re
import unicodedata

MAX_TOOL_PATH = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class PathRefused(ValueError):
    """`code` is a short machine detail: not_string, too_long, control_char, backslash, percent, unicode,
    not_absolute, empty_segment, dot_segment."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def canon_tool_path(value: object) -> str:
    """The path itself when it is absolute and plain; PathRefused otherwise (see the module docstring)."""
    if not isinstance(value, str):
        raise PathRefused("not_string")
    if len(value) > MAX_TOOL_PATH:
        raise PathRefused("too_long")
    if _CONTROL.search(value):
        raise PathRefused("control_char")  # NUL included: C APIs stop there, the check would not
    if "\\" in value:
        raise PathRefused("backslash")
    if "%" in value:
        raise PathRefused("percent")  # %2e%2e or %2f decoded by the tool would escape the prefix
    if not value.isascii() and unicodedata.normalize("NFKC", value) != value:
        raise PathRefused("unicode")  # full-width solidus, one/two dot leaders, full-width full stop...
    if not value.startswith("/"):
        raise PathRefused("not_absolute")
    segments = value[1:].split("/")
    if segments[-1] == "":
        segments.pop()  # one trailing slash names the same directory
    for segment in segments:
        if segment == "":
            raise PathRefused("empty_segment")  # '//': merged by some APIs, a root reset by others
        if segment.strip(". ") == "":
            raise PathRefused("dot_segment")  # '.', '..', '...': traversal or Windows-folded dots
    return value


def under_prefix(path: str, prefix: str) -> bool:
    """`prefix` is canon_tool_path output without its trailing '/' ('' for the root)."""
    return path == prefix or path.startswith(prefix + "/")
