"""Policy errors that name the file and the key path, so an operator can fix the YAML at once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import ValidationError


def key_path(loc: Sequence[str | int]) -> str:
    """('network', 'https', 'allow', 2, 'methods', 0) -> 'network.https.allow[2].methods[0]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"


class PolicyError(ValueError):
    """One or more problems in one policy file. `problems` is a list of (key_path, message)."""

    def __init__(self, file: str, problems: Iterable[tuple[str, str]]) -> None:
        self.file = file
        self.problems = list(problems)
        super().__init__("\n".join(f"{file}: {path}: {message}" for path, message in self.problems))

    @classmethod
    def single(cls, file: str, path: str, message: str) -> PolicyError:
        return cls(file, [(path, message)])

    @classmethod
    def from_validation(
        cls, file: str, error: ValidationError, type_tags: frozenset[str] = frozenset()
    ) -> PolicyError:
        """`type_tags`: names pydantic inserts into `loc` for union members (model class names, tags)."""
        problems: dict[str, str] = {}
        for item in error.errors(include_url=False):
            loc = [p for p in item["loc"] if isinstance(p, int) or not _is_type_tag(p, type_tags)]
            message = item["msg"]
            if item["type"] == "extra_forbidden":
                message = "unknown key (not part of the policy language; check the spelling)"
            problems.setdefault(key_path(loc), message)  # a union reports once per member: keep the first
        return cls(file, problems.items())


_BUILTIN_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_type_tag(part: str, type_tags: frozenset[str]) -> bool:
    return "[" in part or part in _BUILTIN_TAGS or part in type_tags
