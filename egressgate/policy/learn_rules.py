"""Shaping learned observations into rules (the rules are stated in learn.py's docstring)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from egressgate.policy.canon import parse_ip_literal
from egressgate.policy.globs import parse_path_glob
from egressgate.policy.learn_safety import wildcard_parent_ok
from egressgate.policy.limits import MAX_PATHS_PER_RULE

GLOB_MIN_PATHS = 3  # distinct observed paths under one parent before `/parent/*` is proposed
WILDCARD_MIN_HOSTS = 2  # distinct observed subdomains before `*.parent` is proposed
MAX_EXAMPLES = 3
_ID_CHARS = re.compile(r"[^A-Za-z0-9_.:-]")


@dataclass(frozen=True, slots=True)
class Observation:
    key: tuple[str, int]  # (file, line) of the denied record
    kind: str  # "https" | "http" (a request), "connect", "dns"
    host: str
    port: int
    method: str | None
    path: str | None
    sandbox: Any
    reason: str = ""

    def example(self) -> str:
        if self.kind == "dns":
            return f"DNS {self.host}"
        if self.kind == "connect":
            return f"CONNECT {self.host}:{self.port}"
        return f"{self.method} {self.kind}://{self.host}:{self.port}{self.path}"


@dataclass(slots=True)
class Suggestion:
    """One learned rule (or DNS name) and the denied records it would allow."""

    id: str
    section: str  # "https" | "http" | "dns"
    host: str  # exact host or `*.parent`
    ports: tuple[int, ...] = ()
    methods: tuple[str, ...] | None = None
    paths: tuple[str, ...] | None = None
    when_labels: dict[str, str] | None = None
    observations: list[Observation] = field(default_factory=list)
    kind: str = "http"  # "http" (requests seen) | "connect" (only the CONNECT seen) | "dns"
    narrowed_already: bool = False

    @property
    def keys(self) -> set[tuple[str, int]]:
        return {o.key for o in self.observations}

    @property
    def requests(self) -> int:
        return len(self.observations)

    @property
    def hosts(self) -> list[str]:
        return sorted({o.host for o in self.observations})

    def rule(self) -> dict[str, Any]:
        """The rule as policy data (a DNS suggestion is the name itself, see learn._render)."""
        rule: dict[str, Any] = {"id": self.id, "host": self.host, "ports": list(self.ports)}
        if self.methods is not None:
            rule["methods"] = list(self.methods)
        if self.paths is not None:
            rule["paths"] = list(self.paths)
        if self.when_labels:
            rule["when"] = {"labels": dict(self.when_labels)}
        return rule

    def comment_lines(self) -> list[str]:
        sandboxes = len({o.sandbox for o in self.observations})
        reasons = Counter(o.reason for o in self.observations if o.reason)
        why = ", ".join(f"{r} x{n}" for r, n in sorted(reasons.items()))
        lines = [f"{self.id}: {self.requests} denied ({why}) from {sandboxes} "
                 f"sandbox{'es' if sandboxes != 1 else ''}"]
        if self.host.startswith("*."):
            lines.append(f"wildcard over {len(self.hosts)} observed hosts: {', '.join(self.hosts[:5])}"
                         + (", ..." if len(self.hosts) > 5 else ""))
        for glob in self.paths or ():
            if "*" in glob:
                n = len({o.path for o in self.observations if o.path and parse_path_glob(glob).matches(o.path)})
                lines.append(f"{glob} stands for {n} observed paths")
        if self.kind == "connect":
            lines.append("CONNECT only: the tunnel was refused, so its requests were never seen; this rule allows")
            lines.append("any method and path on this host and port: add methods/paths once you know them")
        if self.kind == "dns":
            lines.append("DNS only: makes the name resolvable (for every sandbox of this policy), nothing more")
        counted = Counter(o.example() for o in self.observations)
        for text, n in counted.most_common(MAX_EXAMPLES):
            lines.append(f"  e.g. {text}" + (f" (x{n})" if n > 1 else ""))
        return lines

    def narrowable(self) -> bool:
        return not self.narrowed_already and (
            self.host.startswith("*.") or any("*" in p for p in self.paths or ()))

    def narrowed(self, taken: set[str]) -> list[Suggestion]:
        out = build_suggestions(self.observations, taken, self.when_labels, glob=False, merge=False)
        for s in out:
            s.narrowed_already = True
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "section": self.section, "kind": self.kind, "host": self.host,
            "ports": list(self.ports), "methods": list(self.methods) if self.methods is not None else None,
            "paths": list(self.paths) if self.paths is not None else None, "when_labels": self.when_labels,
            "requests": self.requests, "hosts": self.hosts,
            "sandboxes": len({o.sandbox for o in self.observations}),
            "examples": [o.example() for o in self.observations[:MAX_EXAMPLES]],
        }


def _globbed(paths: set[str], glob: bool) -> tuple[str, ...]:
    """Exact paths, or `/parent/*` for >= GLOB_MIN_PATHS distinct paths directly under one non-root parent
    (every member must match it: a last segment holding %2F is never matched by `*`)."""
    if not glob:
        return tuple(sorted(paths))
    by_parent: dict[str, set[str]] = defaultdict(set)
    for p in paths:
        parent, _, last = p.rpartition("/")
        if parent and last:
            by_parent[parent].add(p)
    out = set(paths)
    for parent, members in by_parent.items():
        if len(members) < GLOB_MIN_PATHS:
            continue
        pattern = parse_path_glob(parent + "/*")
        matching = {m for m in members if pattern.matches(m)}
        if len(matching) >= GLOB_MIN_PATHS:
            out -= matching
            out.add(parent + "/*")
    return tuple(sorted(out))


def _matches(host_pattern: str, host: str) -> bool:
    if host_pattern.startswith("*."):
        return host.endswith(host_pattern[1:]) and parse_ip_literal(host) is None
    return host == host_pattern


def _rule_id(host: str, taken: set[str]) -> str:
    stem = "learned-" + _ID_CHARS.sub("_", host.replace("*.", "any."))[:100]
    candidate, n = stem, 1
    while candidate in taken:
        n += 1
        candidate = f"{stem}-{n}"
    taken.add(candidate)
    return candidate


def build_suggestions(
    observations: Iterable[Observation],
    taken_ids: set[str],
    when: Mapping[str, str] | None,
    *,
    glob: bool = True,
    merge: bool = True,
    refused_hosts: Iterable[str] = (),
) -> list[Suggestion]:
    obs = list(observations)
    taken = set(taken_ids)
    labels = dict(when) if when else None
    # 1. requests: per (scheme, host, port), one shape per set of methods sharing the same paths
    per_target: dict[tuple[str, str, int], dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for o in obs:
        if o.kind in ("https", "http"):
            assert o.method is not None and o.path is not None
            per_target[(o.kind, o.host, o.port)][o.method].add(o.path)
    shapes: dict[tuple[str, int, tuple[str, ...], tuple[str, ...]], list[str]] = defaultdict(list)
    for (scheme, host, port), methods in per_target.items():
        by_paths: dict[tuple[str, ...], list[str]] = defaultdict(list)
        for method, paths in methods.items():
            by_paths[_globbed(paths, glob)].append(method)
        for paths, ms in by_paths.items():
            shapes[(scheme, port, tuple(sorted(ms)), paths)].append(host)
    # 2. hosts with one shape: `*.parent` over >= 2 observed subdomains, else one rule per host
    refused = set(refused_hosts)
    out: list[Suggestion] = []
    for (scheme, port, methods, paths), hosts in sorted(shapes.items()):
        groups: dict[str, list[str]] = {}
        if merge:
            by_parent: dict[str, list[str]] = defaultdict(list)
            for h in hosts:
                if parse_ip_literal(h) is None:
                    by_parent[h.split(".", 1)[1]].append(h)
            for parent, members in by_parent.items():
                if (len(set(members)) >= WILDCARD_MIN_HOSTS and wildcard_parent_ok(parent)
                        and not any(r.endswith("." + parent) for r in refused)):
                    groups["*." + parent] = members
        grouped = {h for members in groups.values() for h in members}
        groups.update({h: [h] for h in sorted(set(hosts)) if h not in grouped})
        for pattern, members in sorted(groups.items()):
            for start in range(0, len(paths), MAX_PATHS_PER_RULE):  # the loader's per-rule limit
                chunk = paths[start:start + MAX_PATHS_PER_RULE]
                globs = [parse_path_glob(p) for p in chunk]
                mine = [o for o in obs if o.kind == scheme and o.port == port and o.host in members
                        and o.method in methods and any(g.matches(o.path or "") for g in globs)]
                out.append(Suggestion(_rule_id(pattern, taken), scheme, pattern, (port,), methods, chunk, labels,
                                      mine))
    # 3. CONNECTs: covered by a learned rule for their host and port, else a host+port rule
    connect_only: dict[str, list[Observation]] = defaultdict(list)
    for o in obs:
        if o.kind != "connect":
            continue
        owner = next((s for s in out if _matches(s.host, o.host) and o.port in s.ports), None)
        if owner is not None:
            owner.observations.append(o)
        else:
            connect_only[o.host].append(o)
    for host, seen in sorted(connect_only.items()):
        ports = tuple(sorted({o.port for o in seen}))
        out.append(Suggestion(_rule_id(host, taken), "https", host, ports, None, None, labels, seen, "connect"))
    # 4. DNS names: covered by any learned rule's host (allow rules make their hosts resolvable)
    dns_only: dict[str, list[Observation]] = defaultdict(list)
    for o in obs:
        if o.kind != "dns":
            continue
        owner = next((s for s in out if _matches(s.host, o.host)), None)
        if owner is not None:
            owner.observations.append(o)
        else:
            dns_only[o.host].append(o)
    for host, seen in sorted(dns_only.items()):
        out.append(Suggestion(f"dns:{host}", "dns", host, observations=seen, kind="dns"))
    return out
