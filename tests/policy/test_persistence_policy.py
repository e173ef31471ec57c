"""The `persistence` section (issue 22 item 5): the article's example loads as written; every entry a runtime
could not honour is refused with its key path; a policy without the section keeps its hash."""

from __future__ import annotations

import hashlib
import json
import textwrap

import pytest

from egressgate.policy.errors import PolicyError
from egressgate.policy.loader import parse_policy
from tests.policy.test_model import SEED

BASE = """
sandbox:
  name: t
  workspace: {path: /workspace, persistent: true}
"""
ARTICLE = """
persistence:
  save: [/workspace/src, /workspace/tests, /workspace/results, /workspace/manifest.json]
  discard: [/tmp, /run, /workspace/.credentials, process_state, shell_history]
  restore_checks: [verify_manifest_hash, rescan_dependencies, reapply_current_policy,
                   reissue_short_lived_credentials]
"""


def load(text: str):
    return parse_policy(textwrap.dedent(text), "p.yaml")


def problems(text: str) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        load(text)
    return info.value.problems


def test_the_articles_example_loads_as_written() -> None:
    policy = load(BASE + ARTICLE)
    p = policy.model.persistence
    assert p is not None
    assert p.save == ["/workspace/src", "/workspace/tests", "/workspace/results", "/workspace/manifest.json"]
    assert p.discard == ["/tmp", "/run", "/workspace/.credentials", "process_state", "shell_history"]
    assert p.restore_checks == [
        "verify_manifest_hash",
        "rescan_dependencies",
        "reapply_current_policy",
        "reissue_short_lived_credentials",
    ]


def test_the_seed_policy_carries_the_articles_persistence() -> None:
    from egressgate.policy.loader import load_policy

    seed = load_policy(SEED)
    assert seed.model.persistence is not None
    assert "process_state" in seed.model.persistence.discard


@pytest.mark.parametrize(
    ("section", "key", "fragment"),
    [
        ("persistence: {save: [/etc]}", "persistence.save[0]", "outside the workspace"),
        ("persistence: {save: [shell_history]}", "persistence.save[0]", "never carried over"),
        ("persistence: {save: [workspace/src]}", "persistence.save[0]", "absolute"),
        ("persistence: {save: [/workspace/a/../b]}", "persistence.save[0]", "normalized"),
        ("persistence: {save: [/workspace/a, /workspace/a]}", "persistence.save[1]", "twice"),
        ("persistence: {discard: [/workspace]}", "persistence.discard[0]", "whole workspace"),
        (
            "persistence: {save: [/workspace/a/b], discard: [/workspace/a]}",
            "persistence.discard[0]",
            "would discard the saved path",
        ),
        ("persistence: {discard: [bash_history]}", "persistence.discard[0]", "process_state, shell_history"),
        (
            "persistence: {restore_checks: [verify_manifest_hash, verify_manifest_hash]}",
            "persistence.restore_checks[1]",
            "twice",
        ),
    ],
)
def test_entries_no_runtime_could_honour_are_refused(section: str, key: str, fragment: str) -> None:
    found = problems(BASE + section)
    assert any(k == key and fragment in m for k, m in found), found


def test_unknown_keys_and_checks_are_refused() -> None:
    assert any("persistence.keep" in k for k, _ in problems(BASE + "persistence: {keep: [/workspace]}"))
    assert any("restore_checks" in k for k, _ in problems(BASE + "persistence: {restore_checks: [trust_me]}"))


def test_persistence_needs_a_persistent_workspace() -> None:
    text = BASE.replace("persistent: true", "persistent: false") + ARTICLE
    assert any(k == "persistence" and "persistent workspace" in m for k, m in problems(text))


def test_positive_control_a_discard_outside_the_workspace_and_a_carve_out_inside_a_save_are_fine() -> None:
    policy = load(BASE + "persistence: {save: [/workspace/src], discard: [/tmp, /workspace/src/.env]}")
    assert policy.model.persistence is not None


def test_a_policy_without_the_section_keeps_its_hash_and_the_section_changes_it() -> None:
    """Audit records name policy hashes: adding the optional section must not change existing ones."""
    without = load(BASE)
    dumped = without.model.model_dump(mode="json", exclude={"mcp", "persistence"})  # the formula before it
    canonical = json.dumps(dumped, sort_keys=True, separators=(",", ":")).encode()
    assert without.hash == "sha256:" + hashlib.sha256(canonical).hexdigest()
    assert load(BASE + ARTICLE).hash != without.hash
