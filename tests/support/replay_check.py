"""Replay a world's audit trail with the policies it ran under: nothing may flip (issue 23, item 1).

Every fact a decision used must be in its record, so `audit replay` with the recording policy re-decides
every record the same way. The worlds call `assert_replays_unchanged` when their gateway stops (the
session fixtures of tests/gateway, tests/escape, tests/approvals, tests/mcp, the budget world of
tests/state_redis, credworld, grpcworld, the control-API harness and the runtime gateways of tests/runtimes),
so every request the suite sends through them is replayed. Records written under another version of a policy (a
reload during a test) are left out: replay answers "what would THIS policy have done".
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from egressgate.audit.find import Found, iter_records
from egressgate.audit.replay import ReplayResult, load_policy_set, replay_records


def trail_files(var: Path) -> list[Path]:
    """The audit files of a var dir in chain order: rotated files (by their UTC stamp), then the live file;
    every worker's chain (`audit.w<N>...`) likewise. Not the retry spool (`audit-retry.jsonl`)."""
    files = [p for p in var.glob("audit.*jsonl") if p.is_file()]
    return sorted(files, key=lambda p: (p.name.split(".")[1].startswith("w"), p.name == "audit.jsonl", p.name))


def replay_own_trail(var: Path, policy_dir: Path) -> tuple[ReplayResult, int]:
    """(result of replaying every record decided under the policies now in `policy_dir`, records left out
    because their policy hash differs: a test reloaded or rewrote that policy)."""
    policies, single = load_policy_set(policy_dir)
    hashes = {name: p.hash for name, p in policies.items()}
    other = 0

    def current() -> list[Found]:
        nonlocal other
        kept = []
        for found in iter_records(trail_files(var)):
            attrs = found.record.attributes
            name, digest = attrs.get("egressgate.policy.name"), attrs.get("egressgate.policy.hash")
            if isinstance(digest, str) and hashes.get(str(name)) != digest:
                other += 1
                continue
            kept.append(found)
        return kept

    return replay_records(current(), policies, single), other


def assert_replays_unchanged(var: Path, policy_dir: Path, min_replayed: int = 0) -> ReplayResult:
    """Fail with the flipped records when the trail's own policies decide any record differently."""
    result, _other = replay_own_trail(var, policy_dir)
    flips = [c.to_json() for c in result.changes]
    assert not flips, f"audit replay of {var} with its own policies flipped {len(flips)} decision(s): {flips[:5]}"
    assert result.replayed >= min_replayed, (var, result)
    return result


def assert_config_replays(config: Path, min_replayed: int = 0) -> ReplayResult:
    """`assert_replays_unchanged` for the gateway `config` (its gateway.yaml) ran: its var dir and policy
    dir (the test harnesses write absolute paths). Call it after the gateway stopped (every outcome is
    written)."""
    doc = yaml.safe_load(config.read_text())
    return assert_replays_unchanged(Path(doc["var_dir"]), Path(doc["policy"]), min_replayed)


def stop_and_replay(gw: Any) -> int:
    """Stop a per-test gateway (tests/support/launcher.stop_gateway) and replay its trail with its own
    policies, unless the test is already failing: called from a `finally`, a replay failure must not hide
    the test's own error (sys.exc_info() there is the exception in flight, if any). Its exit code."""
    from tests.support.launcher import stop_gateway

    code = stop_gateway(gw)
    if sys.exc_info()[1] is None:
        assert_config_replays(gw.config)
    return code
