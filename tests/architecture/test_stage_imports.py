"""The pipeline's stages never import each other (issue 25).

A stage is a module holding an addon master.py registers (read from master.py, not listed here, so the
set cannot drift from the code). A stage may use the shared modules below and helpers of its own, but
never reach another stage module, directly or through any chain of gateway imports (a helper module
that imports a stage would only hide the dependency). What two stages both need lives in a shared module;
each shared module that two or more stages import directly is listed with why it is shared, and reaches
no stage itself. `context.py` (FlowState, ConnState, Runtime) imports no stage and nothing that imports
it back: the types its fields use live with it (flowtypes.py) or in modules that know nothing of it.

Plain and fast: the source is parsed, nothing is imported.
"""

from __future__ import annotations

from tests.architecture.imports import PACKAGE, imports, master_addons, modules, reach

CONTEXT = f"{PACKAGE}.shared.context"

# Modules every stage may import, and why each is shared rather than owned by one stage.
SHARED = {
    "shared.context": "FlowState/ConnState/Runtime: the typed state every stage reads and writes",
    "shared.flowtypes": "the types FlowState's fields use (credential applied, websocket refusal, limit records)",
    "shared.deny": "the deny contract: one Decision and one answer shape for every refusal",
    "shared.emit": "the one module that hands records to the audit sink (building stays in audit/build.py)",
    "shared.counters": "refunds and byte counters: the one refund of a prepayment, the body counters, held reads",
    "shared.flow_decision": "decide_flow(): the one snapshot + decide() (explicit proxy, transparent, tunnels)",
    "shared.sizes": "head and declared body size: what the decision judges and what Budgets prepays, alike",
    "shared.destination": "target resolution: resolve a name, check every address, bind a tunnel to it",
    "shared.target": "what a flow asked for, as sent and canonical (for the records of refused flows too)",
    "shared.request_hash": "the canonical request hash: started by Enforce, fed and finished by Record",
    "shared.misuse": "stream misuse: a phantom credential in a streamed body refuses the flow (Credentials, Enforce)",
    "layers.ws_layer": "the guarded websocket layer's hook payloads and refusal, which the websocket hooks get",
    "shared.sources": "who a connection is: source address, the per-sandbox connection limit, identity answers",
    "shared.ledger": "the byte ledger (meters, top-ups) every counting stage spends from",
    "shared.compose": "the one place a body's stream callable is built (Enforce calls it, MCP hooks into it)",
    "shared.credential_streams": "stream callables over body chunks (scrub, phantom guard, reframe)",
    "layers.tls_limits": "the bounded client TLS layer every layer choice uses",
    "layers.http_limits": "the gateway's HTTP layer with its framing limits, for every layer choice",
    "layers.refuse": "the raw-bytes refusal layer (deny, then close) every layer choice may need",
    "shared.history": "entering a contact into the sandbox's history before bytes go (tunnels, transparent)",
    "layers.refused_layers": "the layers and answers inside a CONNECT refused but accepted (identity, layer choice)",
}


def _stages() -> dict[str, str]:
    """Stage module -> the addon class(es) master.py registers from it."""
    out: dict[str, list[str]] = {}
    for cls, module in master_addons():
        out.setdefault(module, []).append(cls)
    return {module: ", ".join(classes) for module, classes in out.items()}


def _short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def _violations() -> list[str]:
    stages = _stages()
    found = []
    for stage in sorted(stages):
        for other, chain in sorted(reach(stage).items()):
            if other in stages:
                found.append(" -> ".join(_short(m) for m in chain))
    return found


def test_master_registers_stage_modules() -> None:
    """The stage set is read from master.py; a parse that found almost nothing would make the rule vacuous."""
    stages = _stages()
    assert len(stages) >= 10, stages
    assert all(module in modules() for module in stages)


def test_no_stage_module_reaches_another() -> None:
    violations = _violations()
    assert not violations, "stage modules reach other stage modules:\n  " + "\n  ".join(violations)


def test_context_imports_no_stage_and_nothing_that_imports_it() -> None:
    stages = _stages()
    reached = reach(CONTEXT)
    bad = [
        " -> ".join(_short(m) for m in chain)
        for m, chain in sorted(reached.items())
        if m in stages or CONTEXT in imports(m)
    ]
    assert not bad, "context.py reaches a stage or a module importing it back:\n  " + "\n  ".join(bad)


def test_modules_two_stages_share_are_listed_and_reach_no_stage() -> None:
    stages = _stages()
    users: dict[str, set[str]] = {}
    for stage in stages:
        for module in imports(stage):
            if module not in stages:
                users.setdefault(module, set()).add(stage)
    shared = {f"{PACKAGE}.{name}" for name in SHARED}
    unlisted = sorted(_short(m) for m, who in users.items() if len(who) >= 2 and m not in shared)
    assert not unlisted, f"imported by two or more stages but not in SHARED (with its reason): {unlisted}"
    missing = sorted(name for name in SHARED if f"{PACKAGE}.{name}" not in modules())
    assert not missing, f"SHARED names modules that do not exist: {missing}"
    leaking = sorted(
        " -> ".join(_short(x) for x in chain)
        for m in shared
        if m in modules()
        for x, chain in reach(m).items()
        if x in stages
    )
    assert not leaking, "shared modules reach stage modules:\n  " + "\n  ".join(leaking)
