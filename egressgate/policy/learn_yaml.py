"""A YAML writer for learned policies that cannot be steered by what it writes.

Hosts, paths, label keys and the examples in comments come from the audit trail, i.e. from the sandbox.
A YAML library's emitter would quote values correctly but cannot write comments; string-building YAML
by hand is how `#`, newlines, `: `, quotes or a Unicode line separator turn one learned path into extra
rules. So: every scalar is written either plain (only when it is a short safe token that YAML reads back
as the same string) or double-quoted with every character outside printable ASCII escaped; comment text
is reduced to printable ASCII (anything else as a `\\uXXXX` escape); and the finished document is read
back with the policy loader's own YAML reader and must equal the data it was written from, else the
writer refuses (fail closed) rather than hand the operator a file that means something else.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml
from yaml.nodes import ScalarNode

from egressgate.safeyaml import YamlError, load_yaml

_PLAIN = re.compile(r"[A-Za-z0-9/][A-Za-z0-9._/-]{0,200}", re.ASCII)
_STR_TAG = "tag:yaml.org,2002:str"
MAX_COMMENT = 200
MAX_FLOW = 100  # characters of a list written inline


class YamlWriteError(ValueError):
    """The document did not read back as the data it was written from (a bug, never a policy)."""


def comment_text(text: str) -> str:
    """One comment line's content: printable ASCII only, bounded."""
    out = []
    for ch in text:
        code = ord(ch)
        if 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    line = "".join(out)
    return line if len(line) <= MAX_COMMENT else line[: MAX_COMMENT - 3] + "..."


def scalar(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        if "e" in text and "." not in text:  # YAML 1.1 floats need a dot: 1e-05 -> 1.0e-05
            mantissa, _, exp = text.partition("e")
            text = f"{mantissa}.0e{exp}"
        return text
    if isinstance(value, str):
        return _string(value)
    raise YamlWriteError(f"cannot write a {type(value).__name__}")


def _string(value: str) -> str:
    if _PLAIN.fullmatch(value) and yaml.SafeLoader.resolve(yaml.SafeLoader, ScalarNode, value, (True, False)) \
            == _STR_TAG:
        return value
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


Comments = dict[tuple[int, int], list[str]]  # (id(list), index) -> comment lines before that item


def _emit(value: Any, indent: int, lines: list[str], comments: Comments) -> None:
    pad = " " * indent
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise YamlWriteError("mapping keys are strings")
            head = f"{pad}{_string(key)}:"
            flow = _flow(item, comments)
            if flow is not None:
                lines.append(f"{head} {flow}")
            elif isinstance(item, dict | list) and item:
                lines.append(head)
                _emit(item, indent + 2, lines, comments)
            else:
                lines.append(f"{head} {_inline(item)}")
        return
    assert isinstance(value, list)
    for index, item in enumerate(value):
        for text in comments.get((id(value), index), ()):
            lines.append(f"{pad}# {comment_text(text)}" if text else f"{pad}#")
        if isinstance(item, dict | list) and item:
            start = len(lines)
            _emit(item, indent + 2, lines, comments)
            lines[start] = f"{pad}- {lines[start][indent + 2:]}"
        else:
            lines.append(f"{pad}- {_inline(item)}")


def _flow(value: Any, comments: Comments) -> str | None:
    """A short list of scalars without comments as `[a, b]` (plain scalars never hold `,[]{}`: _PLAIN)."""
    if not isinstance(value, list) or not value or any(isinstance(v, dict | list) for v in value):
        return None
    if any((id(value), i) in comments for i in range(len(value))):
        return None
    text = "[" + ", ".join(scalar(v) for v in value) + "]"
    return text if len(text) <= MAX_FLOW else None


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return scalar(value)


def dump(data: dict[str, Any], header: list[str], comments: Comments, *, verify: bool = True) -> str:
    """`data` as block YAML, `header` as leading comment lines, `comments[(id(list), i)]` before list[i].
    `verify=False` only for a caller that checks the meaning itself (learn.py compares policy hashes: one
    YAML parse instead of two, on files up to the loader's 1 MiB)."""
    lines = [f"# {comment_text(h)}" if h else "#" for h in header]
    _emit(data, 0, lines, comments)
    text = "\n".join(lines) + "\n"
    if not verify:
        return text
    try:
        back = load_yaml(text)
    except YamlError as exc:
        raise YamlWriteError(f"learned policy does not parse: {exc}") from None
    if back != data:
        raise YamlWriteError("learned policy does not read back as written")
    return text
