"""`egressgate policy check|explain|test`: the security team's tools for writing rules."""

from __future__ import annotations

import ipaddress
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import click

from egressgate.approvals.grant import KIND_NETWORK, SCOPE_HOST, Grant
from egressgate.policy.canon import CanonError, canon_host
from egressgate.policy.decide import decide
from egressgate.policy.errors import PolicyError
from egressgate.policy.facts import Decision, Facts, Operation, SandboxState
from egressgate.policy.loader import load_policies
from egressgate.policy.mcp_decide import ToolDecision
from egressgate.policy.mcp_explain import explain_tool_call, parse_arguments
from egressgate.policy.reasons import Reason
from egressgate.policy.target import parse_target
from egressgate.policy.testcases import pick_policy, run_case_file, tunnel_mode

EXIT_INVALID = 2
EXIT_DENY = 1  # `policy explain --fail`: the decision is a deny (for scripts and CI checks of a policy)


@click.group()
def policy() -> None:
    """Check, explain and test policies."""


@policy.command()
@click.argument("path", type=click.Path(exists=True))
def check(path: str) -> None:
    """Validate a policy FILE or DIR. Exit 0 when valid, 2 with the file and key path of each error."""
    try:
        policies = load_policies(path)
    except PolicyError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_INVALID)
    refused = [line for _, compiled in sorted(policies.items()) for line in _unenforced_keys(compiled)]
    if refused:
        click.echo("\n".join(refused), err=True)
        sys.exit(EXIT_INVALID)
    for name, compiled in sorted(policies.items()):
        passthrough = sum(r.passthrough for r in compiled.rules)
        spliced = f", {passthrough} tls: passthrough" if passthrough else ""
        spliced += f", {len(compiled.mcp.servers)} mcp servers" if compiled.mcp.servers else ""
        click.echo(f"ok  {name}  {compiled.hash}  ({compiled.source}, {len(compiled.rules)} rules{spliced})")
        for line in _runtime_keys(compiled):
            click.echo(line)


def _unenforced_keys(compiled: Any) -> list[str]:
    """`file: key.path: message` for each key the policy writes that nothing enforces (policy/enforcement.py)."""
    from egressgate.policy.enforcement import NAMED, REFUSED, set_keys

    out = []
    for name in set_keys(compiled.model):
        if NAMED[name].by == REFUSED:
            key, _, value = name.partition("=")
            what = f"{value!r} is" if value else "it is"
            out.append(f"{compiled.source}: {key}: {what} accepted by the schema but nothing enforces it in this "
                       "version; remove it (docs/policy.md, \"Who enforces each key\")")
    return out


def _runtime_keys(compiled: Any) -> list[str]:
    """The runtime-enforced keys the policy sets, each with the runtimes that enforce it."""
    from egressgate.policy.enforcement import NAMED, RUNTIME, runtimes_enforcing, set_keys
    from egressgate.runtimes.registry import ENFORCES

    keys = [name for name in set_keys(compiled.model) if NAMED[name].by == RUNTIME]
    if not keys:
        return []
    lines = ["  runtime keys (enforced by sandbox run; a container routed by hand through the gateway does not "
             "get them):"]
    for name in keys:
        able = runtimes_enforcing(name, ENFORCES)
        lines.append(f"    {name}: {', '.join(able) if able else 'no runtime'}")
    return lines


def _headers(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in values:
        name, sep, value = item.partition(":")
        if not sep or name.strip().lower() not in ("content-type", "accept"):
            raise click.BadParameter(f"expected 'Content-Type: ...' or 'Accept: ...', got {item!r}",
                                     param_hint="--header")
        out[name.strip().lower()] = value.strip()
    return out


def assumed_grant(facts: Facts, decision: Decision, now: float) -> Grant:
    """`explain --approved`: the grant an operator's `approvals approve` (scope host) would create."""
    return Grant(id="apr-explain", sandbox_id="explain", scope=SCOPE_HOST,
                 scheme=facts.scheme if facts.operation is Operation.HTTP_REQUEST else None, host=facts.host,
                 port=facts.port or 0, method=facts.method, path=facts.path, expires_at=now + 60,
                 kind=decision.approval_kind or KIND_NETWORK)


def _label(values: tuple[str, ...]) -> dict[str, str]:
    labels = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected k=v, got {item!r}", param_hint="--label")
        labels[key] = value
    return labels


@policy.command()
@click.option("--policy", "policy_path", type=click.Path(exists=True), help="Policy file or dir.")
@click.option("--sandbox", help="Policy name (sandbox.name); needed when --policy is a directory.")
@click.option("--label", multiple=True, help="Sandbox label k=v (repeatable).")
@click.option("--resolved", multiple=True, help="An address the host resolves to (repeatable).")
@click.option("--elapsed", type=float, default=0.0, help="Seconds since the sandbox was admitted.")
@click.option("--seen", multiple=True, help="A host the sandbox already sent requests to (repeatable).")
@click.option("--header", "headers", multiple=True,
              help="'Content-Type: ...' or 'Accept: ...' of the request (repeatable; they change how it is "
                   "classified: package install, publish).")
@click.option("--approved", is_flag=True,
              help="Assume a live operator approval of the request's kind covers it (shows what passes then).")
@click.option("--json", "as_json", is_flag=True, help="Print the decision as JSON.")
@click.option("--fail", "fail_on_deny", is_flag=True,
              help="Exit 1 when the decision is DENY (default: 0 whatever the decision; 2 on an invalid policy).")
@click.option("--mcp-server", help="Explain an MCP tools/call to this server of the policy (with --tool).")
@click.option("--tool", help="The tool name of the MCP call.")
@click.option("--arguments", default="{}", show_default=True, help="The call's arguments (a JSON object).")
@click.option("--server-calls", type=int, default=0, help="Calls this sandbox already made to the server.")
@click.option("--tool-calls", type=int, default=0, help="Calls this sandbox already made to the tool.")
@click.option("--server-info", help="NAME=VERSION the server reported (default: its pin holds).")
@click.option("--tool-schema", help="sha256 of the tool's listed schema (default: its pin holds).")
@click.argument("request", required=False)
def explain(
    policy_path: str | None,
    sandbox: str | None,
    label: tuple[str, ...],
    resolved: tuple[str, ...],
    elapsed: float,
    seen: tuple[str, ...],
    headers: tuple[str, ...],
    approved: bool,
    as_json: bool,
    fail_on_deny: bool,
    request: str | None,
    **mcp: Any,
) -> None:
    """Show the decision for REQUEST: 'METHOD URL', 'CONNECT host:port' or 'DNS TYPE name'.

    With --mcp-server and --tool: the decision for that MCP tool call (REQUEST is then the policy path,
    or use --policy)."""
    if mcp["mcp_server"] is not None or mcp["tool"] is not None:
        decision = _explain_tool_call(policy_path or request, sandbox, label, as_json, mcp)
        _exit_for(decision.decision, fail_on_deny)
        return
    if policy_path is None or request is None:
        raise click.UsageError("give --policy PATH and REQUEST (or --mcp-server and --tool for an MCP call)")
    try:
        compiled = pick_policy(load_policies(policy_path), sandbox, policy_path)
        given = _headers(headers)
        facts = parse_target(request, tuple(ipaddress.ip_address(a) for a in resolved),
                             given.get("content-type"), given.get("accept"))
        now = time.time()
        state = SandboxState(
            sandbox_id="explain",
            admitted_at=now - elapsed,
            labels=MappingProxyType(_label(label)),
            seen_hosts=frozenset(canon_host(h) for h in seen),
        )
    except PolicyError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_INVALID)
    except (CanonError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="REQUEST") from None
    decision = decide(compiled, facts, state, now)
    if approved and decision.reason is Reason.APPROVAL_REQUIRED:
        decision = decide(compiled, facts, replace(state, approvals=(assumed_grant(facts, decision, now),)), now)
    out = {
        "decision": decision.effect.value,
        "reason": decision.reason.value,
        "rule": decision.rule_id,
        "capability": decision.capability,
        "detail": decision.detail,
        "message": decision.message or None,
        "policy": compiled.name,
        "policy_hash": compiled.hash,
        "canonical": {"host": facts.host, "port": facts.port, "method": facts.method, "path": facts.path},
        "operation": facts.op_class,
        "protocol": facts.op_protocol,
        "approval_kind": decision.approval_kind,
        "tunnel": tunnel_mode(decision) if facts.operation is Operation.CONNECT else None,
    }
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(f"{out['decision'].upper()}  reason={out['reason']}  rule={out['rule'] or '-'}")
        if facts.op_class:
            click.echo(f"operation: {facts.op_class} ({facts.op_protocol})")
        if out["tunnel"]:
            click.echo(f"tunnel: {out['tunnel']}")
        if decision.capability:
            click.echo(f"credential: {decision.capability} (injected by the gateway)")
        if decision.message:
            click.echo(decision.message)
        click.echo(f"policy {compiled.name} {compiled.hash}")
    _exit_for(decision.effect.value, fail_on_deny)


def _exit_for(effect: str, fail_on_deny: bool) -> None:
    """--fail: a script asks "would this be allowed?" by exit code, without parsing the text (exit 0 on a
    DENY would pass a CI check that should fail)."""
    if fail_on_deny and effect == "deny":
        sys.exit(EXIT_DENY)


def _explain_tool_call(
    policy_path: str | None, sandbox: str | None, label: tuple[str, ...], as_json: bool, mcp: dict[str, Any]
) -> ToolDecision:
    if policy_path is None or mcp["mcp_server"] is None or mcp["tool"] is None:
        raise click.UsageError("an MCP call needs the policy (POLICY or --policy), --mcp-server and --tool")
    try:
        compiled = pick_policy(load_policies(policy_path), sandbox, policy_path)
    except PolicyError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_INVALID)
    try:
        arguments = parse_arguments(mcp["arguments"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--arguments") from None
    info = None
    if mcp["server_info"] is not None:
        name, sep, version = mcp["server_info"].partition("=")
        if not sep:
            raise click.BadParameter("expected NAME=VERSION", param_hint="--server-info")
        info = (name, version)
    decision, out = explain_tool_call(
        compiled, mcp["mcp_server"], mcp["tool"], arguments, _label(label), server_calls=mcp["server_calls"],
        tool_calls=mcp["tool_calls"], server_info=info, tool_schema=mcp["tool_schema"], now=time.time())
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return decision
    click.echo(f"{out['decision'].upper()}  reason={out['reason']}  rule={out['rule'] or '-'}"
               + (f"  argument={decision.failed_argument}" if decision.failed_argument else ""))
    if decision.message:
        click.echo(decision.message)
    if decision.budget_keys:
        click.echo("counts: " + ", ".join(f"{key} (max {limit})" for key, limit in decision.budget_keys))
    click.echo(f"policy {compiled.name} {compiled.hash}")
    return decision


@policy.command("test")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--policy", "policy_path", type=click.Path(exists=True), help="Override the files' `policy:`.")
def test_cmd(files: tuple[str, ...], policy_path: str | None) -> None:
    """Run request -> expected-decision cases. Exit 1 on any mismatch, 2 on an invalid file."""
    failed = total = 0
    for file in files:
        try:
            results = run_case_file(Path(file), policy_path)
        except PolicyError as exc:
            click.echo(str(exc), err=True)
            sys.exit(EXIT_INVALID)
        for result in results:
            total += 1
            label = result.case.name or result.case.request
            if result.passed:
                click.echo(f"PASS  {file}#{result.index}  {label}")
                continue
            failed += 1
            click.echo(f"FAIL  {file}#{result.index}  {label}")
            for problem in result.problems:
                click.echo(f"      - {problem}")
            if result.decision is not None and result.decision.message:
                click.echo(f"      message: {result.decision.message}")
    click.echo(f"{total - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


@policy.command()
@click.argument("audit_files", metavar="AUDIT...", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False))
@click.option("--sandbox", "sandbox_id", help="Learn from the traffic of this sandbox id.")
@click.option("--label", multiple=True, help="Learn from sandboxes with label k=v (repeatable: all must match).")
@click.option("--base", "base_path", type=click.Path(exists=True, dir_okay=False),
              help="The policy the sandboxes run under: the output is it plus the learned rules.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the policy here (default: stdout).")
def learn(
    audit_files: tuple[str, ...], sandbox_id: str | None, label: tuple[str, ...], base_path: str | None,
    output: str | None,
) -> None:
    """Propose the smallest rules that allow the denied traffic recorded in the AUDIT files (docs/policy.md,
    "Learning a policy from the audit trail"). Exit 0 with the policy written, 1 when no record of the
    selected sandboxes is found, 2 on a usage error or a base policy that does not load."""
    from egressgate.audit.find import iter_records
    from egressgate.audit.replay import printable
    from egressgate.policy.learn import LearnError, Selector
    from egressgate.policy.learn import learn as learn_rules
    from egressgate.policy.loader import load_policy

    base_yaml = None
    try:
        selector = Selector(sandbox=sandbox_id, labels=_label(label))
        if base_path is not None:
            load_policy(base_path)  # size, type and encoding checks with the loader's own errors
            base_yaml = Path(base_path).read_text("utf-8")
        result = learn_rules(iter_records(list(audit_files)), selector, base_yaml=base_yaml,
                             base_source=base_path or "<base>")
    except LearnError as exc:
        raise click.UsageError(str(exc)) from None
    except PolicyError as exc:
        click.echo(f"the base policy does not load:\n{exc}", err=True)
        sys.exit(EXIT_INVALID)
    if not result.selected:  # most likely a mistyped id or label: say so rather than write the base back
        click.echo("no record of the selected sandboxes in the audit files: nothing learned, nothing written", err=True)
        sys.exit(1)
    if output:
        Path(output).write_text(result.policy_yaml, "utf-8")
    else:
        click.echo(result.policy_yaml, nl=False)
    learned = sum(s.requests for s in result.rules)
    click.echo(f"{len(result.rules)} rules learned from {learned} of {result.denied} denied decisions "
               f"({result.sandboxes} sandboxes, {result.selected} records selected)", err=True)
    for why, n in sorted(result.not_learnable.items()):
        click.echo(f"not learnable {n}: {printable(why)}", err=True)
    flips = [f for f in result.flips if f.direction == "allow->deny"]
    if flips:
        click.echo(f"{len(flips)} recorded allows are not in this policy (no --base?): `egressgate audit replay "
                   "--policy` lists them", err=True)
