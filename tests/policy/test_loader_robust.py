"""Hostile or oversized policy files: every one is a clean PolicyError naming the file (and the line or key
path), and `egressgate policy check` exits 2 without a traceback. Positive controls: the same shapes
within the limits load."""

from __future__ import annotations

from pathlib import Path

import pytest

from egressgate.policy import limits
from egressgate.policy.errors import PolicyError
from egressgate.policy.loader import load_policies, load_policy
from tests.support.cli import cli

ROOT = Path(__file__).resolve().parents[2]
HEAD = "sandbox: {name: x}\n"


def _bomb(levels: int) -> str:
    """Anchors a0..a{levels-1}, each a list of ten aliases to the previous one ("billion laughs")."""
    lines = ["x:", "  - &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"  - &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\ndescription: *a{levels - 1}\n"


HOSTILE = {
    "complex_key": (HEAD + "? [a, b]\n: 1\n", "a key must be a plain string"),
    "complex_mapping_key": (HEAD + "network:\n  ? {a: 1}\n  : 2\n", "a key must be a plain string"),
    "deep_nesting": (HEAD + "description: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than"),
    "deep_block_nesting": (HEAD + "description:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(200)),
                           "nested deeper than"),
    "recursive_alias": (HEAD + "description: &r [*r]\n", "an alias refers to a value that contains it"),
    "non_string_key": (HEAD + "network:\n  1: x\n", "key 1 is not a string"),
    "bool_key": (HEAD + "yes: 1\n", "key True is not a string"),
    "duplicate_key": (HEAD + "sandbox: {name: y}\n", "duplicate key 'sandbox'"),
    "bad_timestamp": (HEAD + "description: 2001-02-30\n", "invalid value"),
    "two_documents": (HEAD + "---\n" + HEAD, "invalid YAML"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_yaml_is_a_policy_error_naming_the_file(tmp_path, name):
    text, expected = HOSTILE[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert str(err.value).startswith(f"{path}: ") and expected in str(err.value), str(err.value)


def test_alias_bomb_refused_fast(tmp_path):
    """9 levels of 10 aliases = 10^9 values once expanded; refused before anything is built."""
    import time

    path = tmp_path / "bomb.yaml"
    path.write_text(HEAD + _bomb(9))
    started = time.monotonic()
    with pytest.raises(PolicyError, match="aliases are expanded"):
        load_policy(path)
    assert time.monotonic() - started < 2


def test_aliases_within_limits_still_load(tmp_path):
    """Positive control: a shared anchor (the legitimate use of aliases) still works."""
    path = tmp_path / "ok.yaml"
    path.write_text(HEAD + "network:\n  dns:\n    allow: &names [a.example, b.example]\n"
                    "  https:\n    allow:\n      - {host: a.example}\n")
    assert load_policy(path).name == "x"


def test_size_limits(tmp_path, monkeypatch):
    big = tmp_path / "big.yaml"
    big.write_text(HEAD + "description: " + "x" * (limits.MAX_POLICY_BYTES + 1) + "\n")
    with pytest.raises(PolicyError, match=f"{big}: <file>: larger than {limits.MAX_POLICY_BYTES} bytes"):
        load_policy(big)
    rules = "".join(f"      - {{host: h{i}.example}}\n" for i in range(limits.MAX_RULES + 1))
    many = tmp_path / "many.yaml"
    many.write_text(HEAD + "network:\n  https:\n    allow:\n" + rules)
    with pytest.raises(PolicyError, match=f"{many}: network: {limits.MAX_RULES + 1} rules; at most"):
        load_policy(many)
    deep = "/" + "/".join(["a"] * (limits.MAX_PATH_SEGMENTS + 1))
    seg = tmp_path / "seg.yaml"
    seg.write_text(HEAD + f"network:\n  https:\n    allow:\n      - {{host: a.example}}\n"
                          f"      - {{host: b.example, paths: ['/ok', '{deep}']}}\n")
    with pytest.raises(PolicyError, match=rf"network\.https\.allow\[1\]\.paths\[1\]: "
                                          rf"{limits.MAX_PATH_SEGMENTS + 1} path segments"):
        load_policy(seg)
    # positive controls: exactly at the limits loads
    at = "/" + "/".join(["a"] * limits.MAX_PATH_SEGMENTS)
    seg.write_text(HEAD + f"network:\n  https:\n    allow:\n      - {{host: b.example, paths: ['{at}']}}\n")
    assert load_policy(seg).name == "x"
    rules = "".join(f"      - {{host: h{i}.example}}\n" for i in range(limits.MAX_RULES))
    many.write_text(HEAD + "network:\n  https:\n    allow:\n" + rules)
    assert len(load_policy(many).rules) == limits.MAX_RULES


def test_a_directory_reports_every_bad_file(tmp_path):
    (tmp_path / "a.yaml").write_text(HEAD + "? [a, b]\n: 1\n")
    (tmp_path / "b.yaml").write_text("sandbox: {name: y}\ndescription: " + "[" * 500 + "]" * 500 + "\n")
    (tmp_path / "c.yaml").write_text("sandbox: {name: z}\n")
    with pytest.raises(PolicyError) as err:
        load_policies(tmp_path)
    text = str(err.value)
    assert f"{tmp_path / 'a.yaml'}: line" in text and f"{tmp_path / 'b.yaml'}: line" in text
    assert "c.yaml" not in text


@pytest.mark.parametrize("name", ["complex_key", "deep_nesting", "recursive_alias"])
def test_policy_check_exits_2_without_traceback(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(HOSTILE[name][0])
    out = cli("policy", "check", str(path))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith(f"{path}: ")


def test_policy_test_case_file_and_gateway_config_use_the_same_bounds(tmp_path):
    """Siblings: the test-case files of `policy test` and the gateway config are YAML from the operator."""
    cases = tmp_path / "cases.yaml"
    cases.write_text("? [a, b]\n: 1\n")
    out = cli("policy", "test", str(cases))
    assert out.returncode == 2 and "Traceback" not in out.stderr and str(cases) in out.stderr
    from egressgate.config import ConfigError, load_config

    cfg = tmp_path / "gw.yaml"
    cfg.write_text("listen: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match=f"{cfg}: line 1, .*nested deeper than"):
        load_config(cfg)
    cfg.write_text("listen: {proxy: '127.0.0.1:0'}\nlisten: {proxy: '127.0.0.1:1'}\n")
    with pytest.raises(ConfigError, match="duplicate key 'listen'"):
        load_config(cfg)


def test_special_files_are_refused_not_read(tmp_path):
    """A FIFO named *.yaml would block the loader (and the gateway's reload) forever."""
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(PolicyError, match=f"{fifo}: <file>: not a regular file"):
        load_policy(fifo)
    (tmp_path / "ok.yaml").write_text(HEAD)
    with pytest.raises(PolicyError, match="not a regular file"):
        load_policies(tmp_path)
