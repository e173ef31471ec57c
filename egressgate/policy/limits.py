"""Size limits of a policy, checked at load time with the key path of the offending value.

A policy is operator input, but it is also loaded by a running gateway on every file change: a file that
is huge, has tens of thousands of rules or path globs hundreds of segments deep makes every reload (and
every request matched against it) slow, so such a file is refused with a sentence that says which limit
was hit. The numbers are far above any real policy (the article's has 6 rules) and are documented in
docs/policy.md ("Limits").
"""

from __future__ import annotations

from egressgate.policy.errors import PolicyError
from egressgate.policy.model import Policy

MAX_POLICY_BYTES = 1024 * 1024  # one policy file
MAX_POLICY_FILES = 1000  # files in a policy directory
MAX_RULES = 5000  # network rules in one policy: https/http/tcp allow+deny plus dns.allow entries
MAX_PATH_SEGMENTS = 32  # '/'-separated segments of one path glob
MAX_PATHS_PER_RULE = 256  # path globs of one rule


def check_limits(model: Policy, source: str) -> None:
    """Raise a PolicyError naming `source` and the key path for every limit `model` exceeds."""
    problems: list[tuple[str, str]] = []
    net = model.network
    sections = {"https": net.https, "http": net.http, "tcp": net.tcp}
    total = len(net.dns.allow) + sum(len(rules.allow) + len(rules.deny) for rules in sections.values())
    if total > MAX_RULES:
        problems.append(("network", f"{total} rules; at most {MAX_RULES} are allowed in one policy "
                                    f"(split it by sandbox, or use host globs)"))
    for scheme in ("https", "http"):
        for effect in ("allow", "deny"):
            for i, rule in enumerate(getattr(sections[scheme], effect)):
                paths = rule.paths or []
                where = f"network.{scheme}.{effect}[{i}].paths"
                if len(paths) > MAX_PATHS_PER_RULE:
                    problems.append((where, f"{len(paths)} paths; at most {MAX_PATHS_PER_RULE} per rule"))
                for j, glob in enumerate(paths):
                    segments = glob.count("/")
                    if segments > MAX_PATH_SEGMENTS:
                        problems.append((f"{where}[{j}]", f"{segments} path segments; at most "
                                                          f"{MAX_PATH_SEGMENTS} (use '**' for any depth)"))
    if problems:
        raise PolicyError(source, problems)
