"""`sandbox run` leaves no policy key silent (issue 22): `sandbox.workspace.persistent: false` refuses a
`--workspace` that would carry state into the next run, and a policy setting a key the chosen runtime does
not enforce, or one nothing enforces, is refused with exit
120 and one sentence before anything is prepared. Each refusal has its positive control: the same run with
the key enforced (or a runtime that enforces it) starts and its workload writes its marker."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.policy.enforcement import runtimes_enforcing
from egressgate.runtimes.registry import ENFORCES
from tests.networld import World
from tests.runtimes.harness import (
    KEPT_WORKSPACE,
    Gateway,
    base_dir,
    remove,
    running_gateway,
    runtime_policy,
    safety_net,
    sandbox_id,
)
from tests.runtimes.runs import leftovers, revocations

pytestmark = pytest.mark.netns

MARK = "echo ran > /workspace/marker"


@pytest.fixture(scope="module")
def gateway(world: World) -> Iterator[Gateway]:
    policies = {
        "wp-fresh": runtime_policy("wp-fresh", sandbox__workspace={"path": "/workspace", "persistent": False}),
        "wp-kept": runtime_policy("wp-kept", sandbox__workspace=KEPT_WORKSPACE),
        "wp-expansion": runtime_policy("wp-expansion", execution__require_approval_for=["network_expansion"]),
    }
    with running_gateway(world, policies) as gw:
        yield gw


def refused(res: subprocess.CompletedProcess[str], *words: str) -> None:
    assert res.returncode == 120, (res.returncode, res.stderr)
    line = next(line for line in res.stderr.splitlines() if "setup failed" in line)
    for word in words:
        assert word in line, line


def nothing_left(gateway: Gateway, res: subprocess.CompletedProcess[str]) -> None:
    """Admitted, refused before prepare, revoked with exit 120 (audited); no host object of the run remains
    in the gateway's namespace (tables, veths) and no run record is left."""
    (rev,) = revocations(gateway, sandbox_id(res.stderr))
    assert rev["egressgate.run.exit_code"] in (120, "120"), rev
    left = leftovers(gateway)
    assert (left["tables"], left["veths"], left["records"]) == ([], [], []), left


def test_a_kept_workspace_needs_persistent_true(gateway: Gateway) -> None:
    ws = base_dir()
    try:
        # persistent: false: a host directory and a named workspace are both refused; the workload never ran
        refused(
            gateway.run("sh", "-c", MARK, policy="wp-fresh", workspace=ws),
            "sandbox.workspace.persistent: false",
            "--workspace",
        )
        assert not (ws / "marker").exists()
        named = subprocess.run(
            gateway.cmd(
                "sandbox",
                "run",
                "--config",
                str(gateway.config),
                "--policy",
                "wp-fresh",
                "--workspace",
                "wp-named",
                "--",
                "sh",
                "-c",
                MARK,
            ),
            capture_output=True,
            text=True,
            timeout=60,
            env=gateway.caller_env(),
            check=False,
            preexec_fn=safety_net,
        )
        refused(named, "sandbox.workspace.persistent: false")
        nothing_left(gateway, named)
        # without --workspace the same policy runs, in a fresh workspace each time
        fresh = gateway.run("sh", "-c", "test ! -e /workspace/marker && " + MARK, policy="wp-fresh")
        assert fresh.returncode == 0, fresh.stderr
        again = gateway.run("sh", "-c", "test ! -e /workspace/marker && " + MARK, policy="wp-fresh")
        assert again.returncode == 0, again.stderr
        # positive control: persistent: true keeps the host directory across runs
        assert gateway.run("sh", "-c", MARK, policy="wp-kept", workspace=ws).returncode == 0
        kept = gateway.run("cat", "/workspace/marker", policy="wp-kept", workspace=ws)
        assert (kept.returncode, kept.stdout) == (0, "ran\n"), kept.stderr
    finally:
        remove(ws)


# `sandbox run` in a Python that first changes what runtimes/registry.py and policy/enforcement.py say: the
# narrow stand-in for a runtime that cannot enforce a key (the shipped runtimes enforce every runtime key) and
# for a key nothing enforces (none is left once every key is enforced). `lacks KEY`: the netns runtime's
# declared set without KEY; `nobody KEY`: KEY's entry says nothing enforces it.
WRAPPER = """
import sys
from egressgate.policy import enforcement
from egressgate.runtimes import registry
mode, key = sys.argv.pop(1), sys.argv.pop(1)
if mode == "lacks":
    registry.ENFORCES["netns"] = registry.ENFORCES["netns"] - {key}
else:
    enforcement.NAMED[key] = enforcement.NAMED[key]._replace(by=enforcement.REFUSED)
from egressgate.cli import main
sys.argv[0] = "egressgate"
main()
"""


def run_wrapped(gateway: Gateway, mode: str, key: str, policy: str, ws: Path) -> subprocess.CompletedProcess[str]:
    argv = gateway.run_argv("sh", "-c", MARK, policy=policy, workspace=ws)
    argv = [*argv[:2], sys.executable, "-c", WRAPPER, mode, key, *argv[3:]]  # nsenter --net=... python -c ...
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env=gateway.caller_env(), check=False, preexec_fn=safety_net
    )


def test_a_key_nothing_enforces_refuses_the_run(gateway: Gateway) -> None:
    ws = base_dir()
    try:
        key = "execution.require_approval_for=network_expansion"
        res = run_wrapped(gateway, "nobody", key, "wp-expansion", ws)
        refused(res, f"runtime netns cannot enforce {key} (enforced by no runtime)")
        assert not (ws / "marker").exists()
        nothing_left(gateway, res)
        # positive control: the same policy where the gateway enforces the key runs
        ok = gateway.run("sh", "-c", MARK, policy="wp-expansion", workspace=ws)
        assert ok.returncode == 0, ok.stderr
        assert (ws / "marker").read_text() == "ran\n"
    finally:
        remove(ws)


def test_a_runtime_that_cannot_enforce_a_key_the_policy_sets_is_refused(gateway: Gateway) -> None:
    ws = base_dir()
    try:
        # wp-kept sets filesystem.deny (the harness policy) and sandbox.workspace.*
        res = run_wrapped(gateway, "lacks", "filesystem.deny", "wp-kept", ws)
        others = ", ".join(r for r in runtimes_enforcing("filesystem.deny", ENFORCES) if r != "netns")
        refused(res, f"runtime netns cannot enforce filesystem.deny (enforced by {others})")
        assert not (ws / "marker").exists()
        nothing_left(gateway, res)
        # positive control: the same wrapper dropping a key the policy does not set runs the workload
        ok = run_wrapped(gateway, "lacks", "sandbox.resources.memory_mb", "wp-kept", ws)
        assert ok.returncode == 0, ok.stderr
        assert (ws / "marker").read_text() == "ran\n"
    finally:
        remove(ws)
