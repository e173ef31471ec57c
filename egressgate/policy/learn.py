"""`policy learn`: the smallest rule set that would have allowed a sandbox's denied traffic.

Pure: records in, a policy text and the suggestions out (no file, no clock, no network); the CLI
(policy/cli.py) and the console (admin/ui) feed it records.

What is learned: `http_request`, `connect` and `dns_query` records of the selected sandboxes denied
because the request was *outside the allowlist* (LEARNABLE_REASONS). Every other denial (budgets,
conditions, deny rules, revoked or unknown sandboxes, forbidden addresses, malformed requests, dependency
failures) is a decision a new allow rule must not undo: it is counted under "not learnable" with its reason.
learn_safety.py says which hosts, addresses and paths are never proposed.

How the rules are shaped (each the narrowest the policy language can say):
* one rule per (scheme, host, port) and per set of methods sharing exactly the same paths (never the
  cross product of methods and paths that were not seen together);
* exact paths, except that >= 3 distinct observed paths with the same non-root parent become
  `/parent/*` (one segment, policies' path-glob syntax: never `**`);
* a CONNECT not covered by a learned HTTPS rule for its host and port (its requests were never seen: the
  tunnel was refused) becomes an https rule for that host and port only, with a comment saying so;
* a denied DNS name not covered by a learned rule (allow rules make their hosts resolvable) becomes an
  exact `network.dns.allow` entry;
* hosts with identical learned rules and >= 2 distinct observed subdomains of one parent become
  `*.parent` (never `*`, never a public suffix or special-use parent);
* never a credential, a `tls:` mode or a raw-TCP rule; with a label selector each rule carries
  `when: {labels: ...}` so it applies only to sandboxes with those labels.

Then the learner checks its own output with the one replay path (audit.replay.replay_records) over the
selected records: a rule that would also allow a request denied for another reason (a glob or wildcard
catching a budget or condition denial) is narrowed to exact hosts and paths, and dropped if it still does.
The output stays within the loader's limits (policy/limits.py: rules split at 256 paths; past MAX_RULES
or 1 MiB the rules covering the fewest denials are dropped and counted), so it loads wherever the base does.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from egressgate.audit.find import Found
from egressgate.audit.record import K_HOST, K_LABELS, K_METHOD, K_OPERATION, K_PATH, K_PORT, K_SCHEME
from egressgate.audit.replay import Flip, RecordLike, as_found, replay_records
from egressgate.policy.errors import PolicyError
from egressgate.policy.learn_rules import Observation, Suggestion, build_suggestions
from egressgate.policy.learn_safety import address_problem, host_problem, method_problem, path_problem
from egressgate.policy.learn_yaml import Comments, dump
from egressgate.policy.limits import MAX_POLICY_BYTES, MAX_RULES
from egressgate.policy.loader import parse_policy, policy_hash
from egressgate.policy.model import Policy, SandboxName
from egressgate.safeyaml import YamlError, load_yaml

LEARNABLE_REASONS = frozenset(
    {"host_not_allowed", "scheme_not_allowed", "port_not_allowed", "method_not_allowed", "path_not_allowed",
     "approval_required"}
)
_DEFAULT_PORTS = {"https": 443, "http": 80}
_OPERATIONS = ("http_request", "connect", "dns_query")


class LearnError(ValueError):
    """The selection or the base cannot be learned from (a usage error, said in one sentence)."""


@dataclass(frozen=True, slots=True)
class Selector:
    """Which sandboxes to learn from: one sandbox id, and/or sandboxes whose labels include `labels`."""

    sandbox: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sandbox is None and not self.labels:
            raise LearnError("select the traffic to learn from: a sandbox id or at least one label")


@dataclass(slots=True)
class LearnResult:
    policy_yaml: str
    rules: list[Suggestion]
    not_learnable: dict[str, int] = field(default_factory=dict)  # why -> denied records
    selected: int = 0  # records of the selected sandboxes
    denied: int = 0  # ... of which denied decisions (http_request, connect, dns_query)
    sandboxes: int = 0
    flips: list[Flip] = field(default_factory=list)  # replay of the selection under policy_yaml

    def to_json(self) -> dict[str, Any]:
        return {
            "policy_yaml": self.policy_yaml,
            "rules": [s.to_json() for s in self.rules],
            "not_learnable": dict(sorted(self.not_learnable.items())),
            "selected": self.selected, "denied": self.denied, "sandboxes": self.sandboxes,
            "flips": [f.to_json() for f in self.flips],
        }


def _selected(found: list[Found], selector: Selector) -> list[Found]:
    """All records of the selected sandboxes. A label selector is resolved to sandbox ids first (labels
    are fixed at admission; records without labels, e.g. DNS ones, still belong to their sandbox)."""
    ids: set[str] | None = None
    if selector.labels:
        ids = set()
        for f in found:
            labels = f.record.attributes.get(K_LABELS)
            if isinstance(labels, dict) and all(labels.get(k) == v for k, v in selector.labels.items()):
                sid = f.record.attributes.get("egressgate.sandbox.id")
                if isinstance(sid, str):
                    ids.add(sid)
    out = []
    for f in found:
        sid = f.record.attributes.get("egressgate.sandbox.id")
        if not isinstance(sid, str) or (selector.sandbox is not None and sid != selector.sandbox):
            continue
        if ids is not None and sid not in ids:
            continue
        out.append(f)
    return out


def _recorded_addresses(attrs: Mapping[str, Any]) -> list[object]:
    out: list[object] = []
    for key in ("egressgate.facts.addresses", "egressgate.dns.answers"):
        value = attrs.get(key)
        if isinstance(value, list):
            out.extend(value)
    for key in ("egressgate.pinned.address", "network.peer.address"):
        if isinstance(attrs.get(key), str):
            out.append(attrs[key])
    return out


def _poisoned_hosts(found: Iterable[Found]) -> dict[str, str]:
    """Hosts some record (any sandbox, any decision) shows resolving to a non-global address: evidence
    about a name, not traffic to learn, so every record counts."""
    bad: dict[str, str] = {}
    for f in found:
        attrs = f.record.attributes
        host = attrs.get(K_HOST) or attrs.get("dns.question.name")
        if isinstance(host, str) and host not in bad:
            why = address_problem(_recorded_addresses(attrs))
            if why is not None:
                bad[host] = why
    return bad


def _observe(f: Found, poisoned: Mapping[str, str]) -> Observation | str:
    """The learnable facts of one denied record, or why it is not learnable."""
    attrs = f.record.attributes
    reason = attrs.get("egressgate.reason")
    if reason not in LEARNABLE_REASONS:
        return str(reason) if isinstance(reason, str) else "no reason recorded"
    op = attrs.get(K_OPERATION)
    host = attrs.get(K_HOST) or attrs.get("dns.question.name")
    why = host_problem(host) or (poisoned.get(host) if isinstance(host, str) else None)
    if why is not None:
        return why
    assert isinstance(host, str)
    key = (f.path, f.line)
    if op == "dns_query":
        return Observation(key, "dns", host, 0, None, None, attrs.get("egressgate.sandbox.id"), reason)
    port = attrs.get(K_PORT)
    if op == "connect":
        if not isinstance(port, int) or not 0 < port < 65536:
            return "malformed port"
        return Observation(key, "connect", host, port, None, None, attrs.get("egressgate.sandbox.id"), reason)
    scheme = attrs.get(K_SCHEME)
    if scheme not in _DEFAULT_PORTS:
        return "scheme not learnable"
    port = port if isinstance(port, int) and 0 < port < 65536 else _DEFAULT_PORTS[scheme]
    method, path = attrs.get(K_METHOD), attrs.get(K_PATH)
    why = method_problem(method) or path_problem(path)
    if why is not None:
        return why
    return Observation(key, scheme, host, port, method, path, attrs.get("egressgate.sandbox.id"), reason)


def learn(
    records: Iterable[RecordLike],
    selector: Selector,
    *,
    base_yaml: str | None = None,
    base_source: str = "<base>",
) -> LearnResult:
    """Learn rules from the denied traffic of `selector`'s sandboxes. With `base_yaml` (the policy the
    sandboxes run under) the result is that policy plus the new rules; without, a policy of only the new
    rules (its name: the records' policy name when they agree, else `learned`).

    Raises LearnError on an invalid selector and PolicyError when the base policy does not load."""
    found = list(as_found(records))
    chosen = _selected(found, selector)
    poisoned = _poisoned_hosts(found)
    not_learnable: Counter[str] = Counter()
    observations: list[Observation] = []
    refused_hosts: set[str] = set(poisoned)
    denied = 0
    for f in chosen:
        attrs = f.record.attributes
        if attrs.get(K_OPERATION) not in _OPERATIONS or attrs.get("egressgate.decision") != "deny":
            continue
        denied += 1
        seen = _observe(f, poisoned)
        if isinstance(seen, str):
            not_learnable[seen] += 1
            host = attrs.get(K_HOST) or attrs.get("dns.question.name")
            if isinstance(host, str):
                refused_hosts.add(host)
        else:
            observations.append(seen)
    base = _base(base_yaml, base_source, chosen)
    when = dict(selector.labels) if selector.labels else None
    suggestions = build_suggestions(observations, base.rule_ids, when, refused_hosts=refused_hosts)
    policy_yaml, flips = _render_checked(base, suggestions, selector, chosen, not_learnable)
    return LearnResult(
        policy_yaml=policy_yaml,
        rules=suggestions,
        not_learnable=dict(not_learnable),
        selected=len(chosen),
        denied=denied,
        sandboxes=len({f.record.attributes.get("egressgate.sandbox.id") for f in chosen}),
        flips=flips,
    )


@dataclass(slots=True)
class _Base:
    data: dict[str, Any]
    rule_ids: set[str]
    source: str | None
    rule_count: int = 0  # as the loader counts them against MAX_RULES
    text: str | None = None


def _base(base_yaml: str | None, source: str, chosen: list[Found]) -> _Base:
    """The base as data. Its YAML is parsed once here; the whole learned file (base included) is then
    compiled by the loader, and a base that does not load is reported by the loader against `source`."""
    if base_yaml is not None:
        try:
            loaded = load_yaml(base_yaml)
            model = Policy.model_validate(loaded)
        except (YamlError, ValidationError):
            parse_policy(base_yaml, source)  # raises the loader's own PolicyError naming the base
            raise  # pragma: no cover - the loader refuses whatever load_yaml/validation refused
        # through JSON: YAML anchors/aliases load as one shared object, and a rule appended to a shared
        # `allow` list would silently land in every section that aliases it
        data = json.loads(json.dumps(loaded))
        net = model.network
        rules = [r for sec in (net.https, net.http, net.tcp) for r in (*sec.allow, *sec.deny)]
        return _Base(data, {r.id for r in rules if r.id}, source, len(rules) + len(net.dns.allow), base_yaml)
    names = {f.record.attributes.get("egressgate.policy.name") for f in chosen} - {None}
    name = names.pop() if len(names) == 1 else "learned"
    if not isinstance(name, str) or not _valid_name(name):
        name = "learned"
    return _Base({"sandbox": {"name": name}, "network": {"default": "deny"}}, set(), None)


def _valid_name(name: str) -> bool:
    from pydantic import TypeAdapter

    try:
        TypeAdapter(SandboxName).validate_python(name)
    except ValidationError:
        return False
    return True


def _render(base: _Base, suggestions: list[Suggestion], selector: Selector) -> tuple[str, dict[str, Any]]:
    import copy

    data = copy.deepcopy(base.data)
    network = data.setdefault("network", {})
    comments: Comments = {}
    for s in suggestions:
        section = network.setdefault(s.section, {})
        entries = section.setdefault("allow", [])
        entries.append(s.host if s.section == "dns" else s.rule())
        comments[(id(entries), len(entries) - 1)] = s.comment_lines()
    what = f"sandbox {selector.sandbox}" if selector.sandbox is not None else "sandboxes"
    if selector.labels:
        what += " with labels " + ", ".join(f"{k}={v}" for k, v in sorted(selector.labels.items()))
    header = [
        f"Learned by `egressgate policy learn` from the denied traffic of {what}.",
        f"Base: {base.source} (its comments are not kept)." if base.source else
        "No --base: this file holds only the learned rules; merge them into the sandbox's policy.",
        "Review every rule before use: the traffic it allows was chosen by the sandbox.",
    ]
    return dump(data, header, comments, verify=False), data


def _render_checked(
    base: _Base, suggestions: list[Suggestion], selector: Selector, chosen: list[Found],
    not_learnable: Counter[str],
) -> tuple[str, list[Flip]]:
    """Render, compile and replay the selection; narrow or drop a rule that flips anything it did not
    learn (the output may allow exactly the learned denials, nothing else that was denied)."""
    _fit_rules(base, suggestions, not_learnable)
    while True:
        text, data = _render(base, suggestions, selector)
        if len(text.encode()) > MAX_POLICY_BYTES:
            _drop_smallest(suggestions, not_learnable, "over the policy size limit",
                           len(text.encode()) - MAX_POLICY_BYTES * 9 // 10)
            continue
        try:
            compiled = parse_policy(text, "<learned policy>")
        except PolicyError as exc:
            if base.text is not None:
                parse_policy(base.text, str(base.source))  # a base that does not load: its own error
            # never expected otherwise: every learned value was checked first
            raise LearnError(f"the learned policy does not load (please report this): {exc}") from None
        # The file must mean exactly the data it was written from (no value or comment can have added,
        # dropped or changed anything): the same policy hash as the intended data, validated directly.
        if compiled.hash != policy_hash(Policy.model_validate(data)):
            raise LearnError("the learned policy does not read back as written (please report this)")
        result = replay_records(iter(chosen), {compiled.name: compiled}, compiled)
        learned_by = {key: s for s in suggestions for key in s.keys}
        culprits: dict[int, Suggestion] = {}
        for c in result.changes:
            if c.new_decision == "allow" and (c.path, c.line) not in learned_by:
                owner = next((s for s in suggestions if s.id == c.new_rule), None)
                if owner is None and c.operation == "dns_query":  # a learned dns.allow[i] entry
                    name = c.target.split(" ", 1)[0]
                    owner = next((s for s in suggestions if s.section == "dns" and s.host == name), None)
                if owner is not None:
                    culprits[id(owner)] = owner
        if not culprits:
            return text, result.changes
        for owner in culprits.values():
            suggestions.remove(owner)
            if owner.narrowable():
                suggestions.extend(owner.narrowed({s.id for s in suggestions} | base.rule_ids))
            else:
                not_learnable["would also allow requests denied for another reason"] += owner.requests


def _fit_rules(base: _Base, suggestions: list[Suggestion], not_learnable: Counter[str]) -> None:
    """Keep the output under the loader's MAX_RULES: the rules covering the most denials win."""
    capacity = max(0, MAX_RULES - base.rule_count)
    if len(suggestions) > capacity:
        suggestions.sort(key=lambda s: -s.requests)
        for s in suggestions[capacity:]:
            not_learnable["over the policy's rule limit"] += s.requests
        del suggestions[capacity:]


def _drop_smallest(suggestions: list[Suggestion], not_learnable: Counter[str], why: str, excess: int) -> None:
    """Drop the suggestions covering the fewest denials until about `excess` bytes are gone."""
    suggestions.sort(key=lambda s: -s.requests)
    while suggestions and excess > 0:
        s = suggestions.pop()
        not_learnable[why] += s.requests
        excess -= 400 + sum(len(p) + 12 for p in s.paths or ()) + len(s.host)
