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

from pydantic import BaseModel, ValidationError

from egressgate.policy import model as policy_model
from egressgate.policy.compile import CompiledPolicy
from egressgate.policy.compiler import compile_policy
from egressgate.policy.errors import PolicyError
from egressgate.policy.limits import MAX_POLICY_BYTES, MAX_POLICY_FILES, check_limits
from egressgate.policy.mcp_model import McpSection
from egressgate.safeyaml import YamlError, load_yaml

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


def policy_hash(model: policy_model.Policy) -> str:
    # A policy without an `mcp` section keeps the hash it had before the section existed (audit replay).
    exclude = {"mcp"} if model.mcp == McpSection() else set()
    if model.persistence is None:  # likewise without a `persistence` section (policy/persistence.py)
        exclude.add("persistence")
    dumped = model.model_dump(mode="json", exclude=exclude or None)
    canonical = json.dumps(dumped, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def parse_policy(text: str, source: str) -> CompiledPolicy:
    """Every way a file can be wrong is a PolicyError naming `source` (and the key path or line when
    known): a traceback here would be an outage in the gateway's reload and in `policy check`."""
    if len(text) > MAX_POLICY_BYTES:  # characters >= bytes/4; load_policy checks the bytes first
        raise PolicyError.single(source, "<file>", f"larger than {MAX_POLICY_BYTES} bytes")
    try:
        data = load_yaml(text)
    except YamlError as exc:
        raise PolicyError.single(source, exc.where, exc.message) from None
    if not isinstance(data, dict):
        raise PolicyError.single(source, "<root>", "a policy is a YAML mapping with a 'sandbox' key")
    try:
        model = policy_model.Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError.from_validation(source, exc, _model_class_names()) from None
    check_limits(model, source)
    return compile_policy(model, source, policy_hash(model))


def load_policy(path: str | Path) -> CompiledPolicy:
    path = Path(path)
    try:
        if not path.is_file():  # a FIFO or device would block the reload thread or never end
            raise PolicyError.single(str(path), "<file>", "not a regular file")
        with path.open("rb") as fh:
            raw = fh.read(MAX_POLICY_BYTES + 1)  # never read an unbounded file into memory
    except OSError as exc:
        raise PolicyError.single(str(path), "<file>", f"cannot read: {exc}") from None
    if len(raw) > MAX_POLICY_BYTES:
        raise PolicyError.single(str(path), "<file>", f"larger than {MAX_POLICY_BYTES} bytes; split the policy")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError.single(str(path), "<file>", f"not UTF-8: {exc}") from None
    return parse_policy(text, str(path))


def load_policies(path: str | Path) -> dict[str, CompiledPolicy]:
    """A file, or every *.yaml / *.yml directly in a directory, keyed by `sandbox.name`.

    All files are checked and every problem is reported together; one bad file fails the whole load,
    because half a policy set silently missing is worse than refusing to start.
    """
    path = Path(path)
    try:
        files = sorted(p for p in path.iterdir() if p.suffix in POLICY_SUFFIXES) if path.is_dir() else [path]
    except OSError as exc:
        raise PolicyError.single(str(path), "<dir>", f"cannot list: {exc}") from None
    if len(files) > MAX_POLICY_FILES:
        raise PolicyError.single(str(path), "<dir>", f"more than {MAX_POLICY_FILES} policy files")
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
        except Exception as exc:  # a bug on odd input is still "this file is refused", never a traceback
            problems.append(PolicyError.single(str(file), "<file>",
                                               f"could not be loaded ({type(exc).__name__}: {exc})"))
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
