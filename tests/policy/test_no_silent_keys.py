"""No silent keys (issue 22): every key the policy loader accepts is enforced (by the gateway, the resolver or
the runtime) or refused. The schema is walked (pydantic `model_fields`, recursively, union members too) and
compared with policy/enforcement.py; every entry names tests that exist (checked by AST, so a renamed or
deleted test breaks this one) and `policy check` / `sandbox run` refuse what nobody enforces."""

from __future__ import annotations

import ast
import types
import typing
from functools import cache
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from egressgate.policy import enforcement
from egressgate.policy.cli import policy as policy_cli
from egressgate.policy.execution import APPROVAL_KINDS
from egressgate.policy.loader import parse_policy
from egressgate.policy.model import Execution, Policy
from egressgate.runtimes.registry import ADAPTERS, ENFORCES

ROOT = Path(__file__).resolve().parents[2]


def _models(tp: object) -> list[tuple[str, type[BaseModel]]]:
    origin = get_origin(tp)
    if origin is typing.Annotated:
        return _models(get_args(tp)[0])
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [("", tp)]
    if origin in (list, tuple):
        return [("[]" + s, m) for s, m in _models(get_args(tp)[0])]
    if origin is dict:
        return [("{}" + s, m) for s, m in _models(get_args(tp)[1])]
    if origin in (typing.Union, types.UnionType):
        return [pair for arg in get_args(tp) for pair in _models(arg)]
    return []


def schema_paths(model: type[BaseModel] = Policy, prefix: str = "") -> set[str]:
    """Every leaf key path the loader accepts; a field holding models is walked into (every union member)."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        subs = _models(field.annotation)
        if not subs:
            out.add(path)
        for suffix, sub in subs:
            out |= schema_paths(sub, path + suffix)
    return out


def test_the_walk_sees_nested_lists_dicts_and_union_members():
    """Positive control for the walker itself: it reaches deep and through the capability union."""
    paths = schema_paths()
    for path in (
        "network.tcp.deny[].when.unless_request_to",
        "credentials.capabilities{}.role",
        "credentials.capabilities{}.placement.basic.username",
        "mcp.servers[].tools.allow[].arguments{}.enum",
        "persistence.restore_checks",
        "sandbox.workspace.persistent",
    ):
        assert path in paths
    assert len(paths) > 150


def test_every_schema_path_has_an_entry_and_no_entry_is_stale():
    paths = schema_paths()
    covered = {p.split("=", 1)[0] for p in enforcement.index()}
    assert sorted(paths - covered) == [], "policy keys without an entry in policy/enforcement.py"
    assert sorted(covered - paths) == [], "entries in policy/enforcement.py for keys the schema does not have"
    assert len(set(enforcement.index())) == sum(len(enforcement.expand(k.name)) for k in enforcement.KEYS), (
        "a path is listed by two entries"
    )


def test_keys_enforced_per_value_cover_every_value():
    """package_install's literal values and every approval kind have their own entry (who enforces a value
    differs), and no value entry is stale."""
    values = {
        "execution.package_install": set(get_args(Execution.model_fields["package_install"].annotation)),
        "execution.require_approval_for": set(APPROVAL_KINDS),
    }
    assert set(values) == set(enforcement.BY_VALUE)
    for key, wanted in values.items():
        have = {p.split("=", 1)[1] for p in enforcement.index() if p.startswith(key + "=")}
        assert have == wanted, key
        assert key not in enforcement.index()  # only per value
    assert get_origin(Execution.model_fields["package_install"].annotation) is Literal


@cache
def _tests_in(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    return frozenset(
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    )


def test_every_entry_names_tests_that_exist():
    assert all(k.by in ("gateway", "resolver", "runtime", "loader", "refused") for k in enforcement.KEYS)
    missing = []
    for key in enforcement.KEYS:
        assert key.tests, f"{key.name}: no test named"
        for ref in key.tests:
            path, _, name = ref.partition("::")
            if not (ROOT / path).is_file() or name not in _tests_in(path):
                missing.append(f"{key.name}: {ref}")
    assert missing == []


def test_every_runtime_declares_its_set_and_only_runtime_keys():
    assert set(ENFORCES) == set(ADAPTERS), "a runtime in runtimes/registry.py without an ENFORCES line"
    for runtime, keys in ENFORCES.items():
        assert keys <= enforcement.RUNTIME_KEYS, runtime
    # netns, docker and gVisor enforce every runtime key (read in their code: registry.py says where)
    assert {r for r, keys in ENFORCES.items() if keys == enforcement.RUNTIME_KEYS} >= {"netns", "docker", "gvisor"}


BASE = "sandbox: {name: sb}\n"


def test_set_keys_names_what_a_policy_writes():
    seed = parse_policy((ROOT / "policies/seed-invoice-analysis.yaml").read_text(), "seed.yaml")
    keys = enforcement.set_keys(seed.model)
    assert "sandbox.root_fs" in keys and "execution.commands" in keys and "persistence.restore_checks" in keys
    assert "execution.package_install=deny" in keys and "execution.require_approval_for=publish" in keys
    assert "execution.require_approval_for=network_expansion" in keys
    # positive control: a minimal policy writes only its name; defaults are not "set" except those that
    # constrain (a read-only root, a bounded /tmp): a runtime that cannot enforce them must not run it
    assert enforcement.set_keys(parse_policy(BASE, "p.yaml").model) == [
        "sandbox.name",
        "sandbox.root_fs",
        "sandbox.tmp.max_bytes",
    ]


# A key marked as enforced by nobody for the tests of the refusal mechanism, so they hold whatever the table
# says today (once every key is enforced there is no real one left). The real refused entries are checked by
# test_policy_check_refuses_every_key_the_table_says_nothing_enforces.
NOBODY = "execution.require_approval_for=network_expansion"
NOBODY_LINE = "execution: {require_approval_for: [network_expansion]}\n"


@pytest.fixture
def nobody(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(enforcement.NAMED, NOBODY, enforcement.NAMED[NOBODY]._replace(by=enforcement.REFUSED))
    return NOBODY


def test_unenforced_is_what_the_runtime_lacks_plus_what_nobody_enforces(nobody: str):
    keys = ["sandbox.root_fs", "filesystem.deny", "network.dns.allow", nobody]
    enforces = {"full": enforcement.RUNTIME_KEYS, "partial": enforcement.RUNTIME_KEYS - {"filesystem.deny"}}
    assert enforcement.unenforced(keys, "full", enforces) == [nobody]
    assert enforcement.unenforced(keys, "partial", enforces) == ["filesystem.deny", nobody]
    sentence = enforcement.refusal(["filesystem.deny", nobody], "partial", enforces)
    assert sentence == (
        f"runtime partial cannot enforce filesystem.deny (enforced by full); {nobody} (enforced by no runtime), "
        "which the policy sets; use a runtime that does, or drop the key"
    )
    # positive control: what the runtime enforces, and what the gateway or resolver does, is not listed
    assert enforcement.unenforced(["sandbox.root_fs", "network.dns.allow"], "partial", enforces) == []


def _check(tmp_path: Path, text: str):
    (tmp_path / "p.yaml").write_text(text)
    return CliRunner().invoke(policy_cli, ["check", str(tmp_path / "p.yaml")])


def test_policy_check_refuses_keys_nobody_enforces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # positive control first: while something enforces it, the key passes
    result = _check(tmp_path, BASE + NOBODY_LINE)
    assert result.exit_code == 0 and result.output.startswith("ok  sb  "), result.output
    monkeypatch.setitem(enforcement.NAMED, NOBODY, enforcement.NAMED[NOBODY]._replace(by=enforcement.REFUSED))
    result = _check(tmp_path, BASE + NOBODY_LINE)
    assert result.exit_code == 2, result.output
    assert (
        f"{tmp_path / 'p.yaml'}: execution.require_approval_for: 'network_expansion' is accepted by the schema but "
        "nothing enforces it in this version" in result.output
    )


def test_policy_check_refuses_every_key_the_table_says_nothing_enforces(tmp_path: Path):
    """Each real `refused` entry (a `key=value` one here) written in a policy: exit 2 naming it."""
    for key in (k for k in enforcement.KEYS if k.by == enforcement.REFUSED):
        path, _, value = key.name.partition("=")
        assert value and path in enforcement.BY_VALUE, f"{key.name}: write a policy line for it here"
        section, field = path.split(".")
        yaml_value = f"[{value}]" if field == "require_approval_for" else value
        result = _check(tmp_path, BASE + f"{section}: {{{field}: {yaml_value}}}\n")
        assert result.exit_code == 2, (key.name, result.output)
        assert f"p.yaml: {path}: {value!r} is accepted by the schema but nothing enforces it" in result.output


def _able(key: str) -> str:
    return ", ".join(enforcement.runtimes_enforcing(key, ENFORCES))


def test_policy_check_names_the_runtime_keys_and_their_runtimes(tmp_path: Path):
    result = _check(
        tmp_path,
        BASE.rstrip("}\n") + ", root_fs: read_only, resources: {memory_mb: 64}}\n"
        "network: {dns: {allow: [a.example]}}\n",
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("ok  sb  ")
    assert (
        "  runtime keys (enforced by sandbox run; a container routed by hand through the gateway does not get them):"
        in lines
    )
    assert f"    sandbox.resources.memory_mb: {_able('sandbox.resources.memory_mb')}" in lines
    assert f"    sandbox.root_fs: {_able('sandbox.root_fs')}" in lines
    assert "netns" in _able("sandbox.root_fs") and "docker" in _able("sandbox.root_fs")
    assert not any("network.dns" in line for line in lines[1:])  # the resolver's key is not a runtime key
    # a minimal policy still lists the defaults that constrain (the sandbox's read-only root, bounded /tmp)
    result = _check(tmp_path, BASE)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[2:] == [
        f"    sandbox.root_fs: {_able('sandbox.root_fs')}",
        f"    sandbox.tmp.max_bytes: {_able('sandbox.tmp.max_bytes')}",
    ]


def test_admission_hands_out_the_keys_the_policy_sets():
    """admission_keys (the admission's `runtime_policy.keys`): set_keys, shared rule entries named once,
    memoized per policy hash; `sandbox run` keeps the runtime and refused ones."""
    text = (
        BASE.rstrip("}\n") + ", workspace: {path: /workspace, persistent: true}}\n"
        "filesystem: {deny: [/etc/shadow]}\n"
        "network: {https: {allow: [{host: a.example}, {host: b.example, ports: [443]}]}}\n"
        "execution: {require_approval_for: [persistent_write, network_expansion]}\n"
    )
    compiled = parse_policy(text, "p.yaml")
    keys = enforcement.admission_keys(compiled.model, compiled.hash)
    assert keys == enforcement.set_keys(compiled.model)
    assert "network.{https,http,tcp}.{allow,deny}[].host" in keys
    assert enforcement.admission_keys(compiled.model, compiled.hash) == keys
    full = {"full": enforcement.RUNTIME_KEYS}
    assert enforcement.unenforced(keys, "full", full) == []
    assert enforcement.unenforced(keys, "none", full) == [
        "execution.require_approval_for=persistent_write",
        "filesystem.deny",
        "sandbox.root_fs",
        "sandbox.tmp.max_bytes",
        "sandbox.workspace.path",
        "sandbox.workspace.persistent",
    ]
    # a key sandbox run's table does not know (a newer gateway's) is refused, never ignored
    assert enforcement.unenforced(["sandbox.hypothetical"], "full", full) == ["sandbox.hypothetical"]


def test_docs_table_is_the_enforcement_table():
    """docs/policy.md, "Who enforces each key": the generated table between its markers, unchanged."""
    text = (ROOT / "docs" / "policy.md").read_text(encoding="utf-8")
    begin = "<!-- keys:begin (generated from egressgate/policy/enforcement.py: markdown_table) -->\n"
    inside = text.split(begin, 1)[1].split("<!-- keys:end -->", 1)[0]
    assert inside == enforcement.markdown_table(ENFORCES)
    # positive control: a row per entry, and the refused keys stand out
    assert inside.count("\n") == len(enforcement.KEYS) + 2
    assert "| `sandbox.workspace.persistent` | `sandbox run` | runtimes/run.py |" in inside


def test_allow_entries_for_the_sandboxs_own_workspace_and_tmp_set_nothing():
    """The seed's `filesystem.allow` names only /workspace and /tmp (always present, every runtime): no
    runtime key; a host path is one (netns binds it, docker mounts it, a runtime that cannot must refuse)."""
    own = BASE.rstrip("}\n") + ", workspace: {path: /workspace}}\n"
    text = (
        own
        + "filesystem: {allow: [{path: /workspace, read: true, write: true}, {path: /tmp, read: true, write: true}]}\n"
    )
    assert not [k for k in enforcement.set_keys(parse_policy(text, "p.yaml").model) if k.startswith("filesystem")]
    text = own + "filesystem: {allow: [{path: /tmp, read: true, write: true}, {path: /opt/data, read: true}]}\n"
    assert [k for k in enforcement.set_keys(parse_policy(text, "p.yaml").model) if k.startswith("filesystem")] == [
        "filesystem.allow[].path",
        "filesystem.allow[].read",
    ]
