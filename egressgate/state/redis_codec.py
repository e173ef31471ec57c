"""How a SandboxRecord and the counters look in Redis (hash fields), and back.

Strings only, JSON for the nested values; the token is only ever its SHA-256 (base.hash_token), so a
dump of Redis cannot impersonate a sandbox. Decoding rejects a record it cannot read as a whole
(StateUnavailable): a half-read record must never decide anything.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping, Sequence

from egressgate.policy.facts import RuleUsage
from egressgate.policy.globs import HostPattern
from egressgate.state.base import SandboxRecord, StateUnavailable


def encode_record(record: SandboxRecord) -> dict[str, str]:
    return {
        "id": record.id,
        "token_hash": record.token_hash,
        "policy": record.policy_name,
        "admitted_at": repr(float(record.admitted_at)),
        "labels": json.dumps(record.labels, sort_keys=True),
        "addresses": json.dumps(list(record.addresses)),
        "phantoms": json.dumps(record.phantoms, sort_keys=True),
        "revoked": "1" if record.revoked else "0",
    }


def pairs(flat: Sequence[str]) -> dict[str, str]:
    """A Lua HGETALL reply (field, value, field, value, ...) as a dict."""
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def decode_record(fields: Mapping[str, str]) -> SandboxRecord | None:
    if not fields:
        return None
    try:
        return SandboxRecord(
            id=fields["id"],
            token_hash=fields["token_hash"],
            policy_name=fields["policy"],
            admitted_at=float(fields["admitted_at"]),
            labels=dict(json.loads(fields["labels"])),
            addresses=tuple(json.loads(fields["addresses"])),
            revoked=fields["revoked"] == "1",
            phantoms=dict(json.loads(fields["phantoms"])),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise StateUnavailable(f"sandbox record in Redis is incomplete or corrupt ({exc!r})") from exc


def decode_usage(flat: Sequence[str]) -> dict[str, RuleUsage]:
    """Usage hash fields `r:<rule>` (requests) and `b:<rule>` (bytes) → {rule: RuleUsage}."""
    requests: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for field, value in pairs(flat).items():
        kind, _, rule = field.partition(":")
        (requests if kind == "r" else nbytes)[rule] = int(value)
    return {rule: RuleUsage(requests=requests.get(rule, 0), bytes=nbytes.get(rule, 0))
            for rule in requests.keys() | nbytes.keys()}


def rev_host(host: str) -> str:
    """Labels reversed ("api.example.com" -> "com.example.api"): the history's sort key, so the hosts
    under a suffix are one lexicographic range. Its own inverse."""
    return ".".join(reversed(host.split(".")))


def history_spec(history: bool | Collection[HostPattern]) -> dict:
    """What the snapshot script reads of the history: all of it, none, or the hosts some patterns
    could match (exact names, and the ranges under each suffix; "any" means all)."""
    if history is True:
        return {"h": "all"}
    if history is False or not history:
        return {"h": "none"}
    patterns = list(history)
    if any(p.kind == "any" for p in patterns):
        return {"h": "all"}
    return {"h": "some", "x": [rev_host(p.value) for p in patterns if p.kind == "exact"],
            "s": [rev_host(p.value) + "." for p in patterns if p.kind == "suffix"]}


def snapshot_spec(history: bool | Collection[HostPattern], rules: Collection[str] | None, record: bool) -> str:
    """The SNAPSHOT script's argument (lua.py): what to read of the history and the rules' usage, and
    whether the record too. A policy's patterns and rules are the same objects request after request:
    the JSON is made once per policy (cached), not per request."""
    try:
        return _snapshot_spec(history, rules, record)
    except TypeError:  # an unhashable collection: made afresh
        return _snapshot_spec.__wrapped__(history, rules, record)


@functools.lru_cache(maxsize=256)
def _snapshot_spec(history: bool | Collection[HostPattern], rules: Collection[str] | None, record: bool) -> str:
    spec = history_spec(history)
    spec["rec"] = 1 if record else 0
    if rules is not None:
        spec["r"] = list(rules)
    return json.dumps(spec)


@functools.lru_cache(maxsize=4096)
def sandbox_keys(prefix: str, sandbox_id: str) -> tuple[str, str, str, str, str]:
    """A sandbox's ctr, hosts, hist, usage and sbx keys (RedisState.key's layout), made once per
    sandbox, not per request."""
    return (f"{prefix}ctr:{sandbox_id}", f"{prefix}hosts:{sandbox_id}", f"{prefix}hist:{sandbox_id}",
            f"{prefix}usage:{sandbox_id}", f"{prefix}sbx:{sandbox_id}")
