"""Load policy files and directories; compute the policy hash.

The policy hash is SHA-256 over the canonical JSON of the *validated model* (sorted keys, compact
separators, defaults filled in), so reformatting a file or reordering its keys keeps the hash, while any
change in meaning changes it. Audit records carry it; `audit replay` uses it to say under which policy a
decision was made.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from egressgate.policy import model as policy_model
from egressgate.policy.compile import CompiledPolicy, compile_policy
from egressgate.policy.errors import PolicyError

POLICY_SUFFIXES = (".yaml", ".yml")


def _model_class_names() -> frozenset[str]:
    names = set()
    stack: list[type] = [BaseModel]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            names.add(sub.__name__)
            stack.append(sub)
    return frozenset(names)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: YAML's last-one-wins would silently drop a rule."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def policy_hash(model: policy_model.Policy) -> str:
    canonical = json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def parse_policy(text: str, source: str) -> CompiledPolicy:
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<document>"
        raise PolicyError.single(source, where, f"invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise PolicyError.single(source, "<root>", "a policy is a YAML mapping with a 'sandbox' key")
    try:
        model = policy_model.Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError.from_validation(source, exc, _model_class_names()) from None
    return compile_policy(model, source, policy_hash(model))


def load_policy(path: str | Path) -> CompiledPolicy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError.single(str(path), "<file>", f"cannot read: {exc}") from None
    return parse_policy(text, str(path))


def load_policies(path: str | Path) -> dict[str, CompiledPolicy]:
    """A file, or every *.yaml / *.yml directly in a directory, keyed by `sandbox.name`.

    All files are checked and every problem is reported together; one bad file fails the whole load,
    because half a policy set silently missing is worse than refusing to start.
    """
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.suffix in POLICY_SUFFIXES) if path.is_dir() else [path]
    if path.is_dir() and not files:
        raise PolicyError.single(str(path), "<dir>", "no *.yaml policy files in this directory")
    policies: dict[str, CompiledPolicy] = {}
    problems: list[PolicyError] = []
    for file in files:
        try:
            policy = load_policy(file)
        except PolicyError as exc:
            problems.append(exc)
            continue
        if policy.name in policies:
            other = policies[policy.name].source
            problems.append(PolicyError.single(str(file), "sandbox.name", f"{policy.name!r} is also in {other}"))
            continue
        policies[policy.name] = policy
    if problems:
        raise PolicySetError(problems)
    return policies


class PolicySetError(PolicyError):
    """Problems in several files of a policy directory."""

    def __init__(self, errors: list[PolicyError]) -> None:
        self.errors = errors
        self.file = errors[0].file
        self.problems = [p for e in errors for p in e.problems]
        ValueError.__init__(self, "\n".join(str(e) for e in errors))
