"""Policy test files: request -> expected decision cases that security teams keep beside their rules.

```yaml
policy: ../policies/seed-invoice-analysis.yaml   # relative to this file (or --policy on the CLI)
sandbox: invoice-analysis                         # needed when `policy` is a directory
cases:
  - request: POST https://api.openai.com/v1/responses
    expect: allow
    rule: https.allow[0]                          # optional
  - request: GET https://api.openai.com/v1/models
    expect: deny
    reason: method_not_allowed                    # optional
  - request: GET https://files.pythonhosted.org/x
    resolved: [10.0.0.5]                          # addresses the name resolves to (optional)
    labels: {team: finance}                       # sandbox labels (optional)
    elapsed_seconds: 30                           # time since admission (optional, default 0)
    seen_hosts: [vault.internal.example]          # earlier requests (optional)
    expect: deny
  - request: CONNECT objects.githubusercontent.com:443
    expect: allow
    tunnel: passthrough                           # CONNECT only: intercept | passthrough | tcp (optional)
  - request: GET https://mirror.example/simple/requests/
    headers: {Accept: application/vnd.pypi.simple.v1+json}   # Content-Type / Accept (optional)
    operation: package_install                    # package_install | publish | none (optional)
    expect: deny
    reason: package_install_denied
```
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from egressgate.policy.canon import CanonError, canon_host
from egressgate.policy.compile import CompiledPolicy
from egressgate.policy.decide import decide
from egressgate.policy.errors import PolicyError
from egressgate.policy.facts import Decision, SandboxState
from egressgate.policy.loader import load_policies
from egressgate.policy.target import parse_target
from egressgate.safeyaml import YamlError, load_yaml

FIXED_NOW = 1_700_000_000.0  # test cases are about elapsed time, not wall-clock time


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    request: str
    expect: Literal["allow", "deny"]
    reason: str | None = None
    rule: str | None = None
    resolved: list[str] = []
    labels: dict[str, str] = {}
    elapsed_seconds: float = 0
    seen_hosts: list[str] = []
    sandbox_id: str = "policy-test"
    # the request's Content-Type / Accept (classification by protocol: policy/opclass.py); other names refused
    headers: dict[Literal["Content-Type", "Accept", "content-type", "accept"], str] = {}
    operation: Literal["package_install", "publish", "none"] | None = None  # the class the request must get
    tunnel: Literal["intercept", "passthrough", "tcp"] | None = None


class CaseFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: str | None = None
    sandbox: str | None = None
    cases: list[Case]


@dataclass(frozen=True, slots=True)
class CaseResult:
    case: Case
    index: int
    decision: Decision | None
    problems: tuple[str, ...]  # empty when the case passed

    @property
    def passed(self) -> bool:
        return not self.problems


def tunnel_mode(decision: Decision) -> str | None:
    """How the gateway carries an allowed CONNECT: `intercept` (TLS terminated, every request decided),
    `passthrough` (TLS spliced after the SNI check) or `tcp` (raw relay); None for a deny."""
    if not decision.allowed:
        return None
    return "passthrough" if decision.passthrough else "intercept" if decision.intercept else "tcp"


def pick_policy(policies: dict[str, CompiledPolicy], sandbox: str | None, where: str) -> CompiledPolicy:
    if sandbox is not None:
        if sandbox not in policies:
            raise PolicyError.single(where, "sandbox", f"no policy named {sandbox!r}; have {sorted(policies)}")
        return policies[sandbox]
    if len(policies) != 1:
        raise PolicyError.single(where, "sandbox", f"several policies loaded {sorted(policies)}; name one")
    return next(iter(policies.values()))


def load_case_file(path: Path) -> CaseFile:
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
        return CaseFile.model_validate(data)
    except (OSError, UnicodeDecodeError, YamlError) as exc:
        raise PolicyError.single(str(path), "<file>", str(exc)) from None
    except ValidationError as exc:
        raise PolicyError.from_validation(str(path), exc) from None


def case_state(case: Case, now: float) -> SandboxState:
    return SandboxState(
        sandbox_id=case.sandbox_id,
        admitted_at=now - case.elapsed_seconds,
        labels=MappingProxyType(dict(case.labels)),
        seen_hosts=frozenset(canon_host(h) for h in case.seen_hosts),
    )


def run_case(policy: CompiledPolicy, case: Case, index: int) -> CaseResult:
    try:
        addresses = tuple(ipaddress.ip_address(a) for a in case.resolved)
        headers = {k.lower(): v for k, v in case.headers.items()}
        facts = parse_target(case.request, addresses, headers.get("content-type"), headers.get("accept"))
        decision = decide(policy, facts, case_state(case, FIXED_NOW), FIXED_NOW)
    except (CanonError, ValueError) as exc:
        return CaseResult(case, index, None, (f"request could not be evaluated: {exc}",))
    problems = []
    if decision.effect.value != case.expect:
        problems.append(f"expected {case.expect}, got {decision.effect.value} ({decision.reason.value})")
    if case.reason is not None and decision.reason.value != case.reason:
        problems.append(f"expected reason {case.reason}, got {decision.reason.value}")
    if case.rule is not None and decision.rule_id != case.rule:
        problems.append(f"expected rule {case.rule}, got {decision.rule_id}")
    if case.operation is not None and (facts.op_class or "none") != case.operation:
        problems.append(f"expected operation {case.operation}, got {facts.op_class or 'none'}")
    if case.tunnel is not None and tunnel_mode(decision) != case.tunnel:
        problems.append(f"expected tunnel {case.tunnel}, got {tunnel_mode(decision)}")
    return CaseResult(case, index, decision, tuple(problems))


def run_case_file(path: Path, policy_override: str | None = None) -> list[CaseResult]:
    cases = load_case_file(path)
    source = policy_override or cases.policy
    if source is None:
        raise PolicyError.single(str(path), "policy", "no policy given (set `policy:` or pass --policy)")
    policy_path = Path(source) if policy_override else (path.parent / source)
    policy = pick_policy(load_policies(policy_path), cases.sandbox, str(path))
    return [run_case(policy, case, i) for i, case in enumerate(cases.cases)]
