"""Persistence without authority (issue 22 items 4 and 5), end to end: the real gateway, real `sandbox run`
(netns + bubblewrap) on named workspaces the runtime keeps in its var dir.

* save/discard: only `save` paths survive a run; `discard` paths and shell history are dropped; the manifest
  hash is in the audit chain and matches the kept files;
* verify_manifest_hash: a workspace changed between runs is refused (exit 120, audited, the workload never
  starts); `--accept-changes` restores it (audited with who accepted); an untouched one restores;
* reapply_current_policy: a restore after a policy change names the previous and the current policy hash;
* reissue_short_lived_credentials: the previous run's token is refused after the restore (a real request),
  the new one works; a previous sandbox left admitted is revoked by the restore;
* rescan_dependencies: a package the last run installed is named in the restore record;
* persistent_write: the run's changes wait as one approval listing every path with size and sha256; approve
  -> in the workspace, deny / expiry -> gone; a pending write blocks the next run.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from egressgate.runtimes import manifest
from tests.networld import World
from tests.runtimes.harness import Gateway, running_gateway, runtime_policy, safety_net, sandbox_id
from tests.runtimes.runs import loops_freed

pytestmark = pytest.mark.netns

PERSIST = {
    "save": ["/workspace/src", "/workspace/results"],
    "discard": ["/tmp", "/workspace/src/.credentials", "process_state", "shell_history"],
    "restore_checks": [
        "verify_manifest_hash",
        "rescan_dependencies",
        "reapply_current_policy",
        "reissue_short_lived_credentials",
    ],
}
WS = {"path": "/workspace", "persistent": True}


def policy(name: str, **extra: Any) -> dict:
    extra.setdefault("sandbox__workspace", WS)
    return runtime_policy(
        name,
        persistence__save=PERSIST["save"],
        persistence__discard=PERSIST["discard"],
        persistence__restore_checks=PERSIST["restore_checks"],
        **extra,
    )


def phantom_policy() -> dict:
    """ps-keep plus a phantom credential admission puts in the workload's environment (EGN_KEY)."""
    p = policy("ps-phantom")
    p["network"]["https"]["allow"].append({"id": "phantom", "host": "phantom.allowed.test", "credential": "fake"})
    p["credentials"] = {
        "capabilities": {
            "fake": {
                "type": "static",
                "source": {"file": "/nonexistent/egN-secret"},
                "placement": {"header": "x-api-key"},
                "mode": "phantom",
                "phantom_env": "EGN_KEY",
            }
        }
    }
    return p


@pytest.fixture(scope="module")
def gw(world: World) -> Iterator[Gateway]:
    policies = {
        "ps-keep": policy("ps-keep"),
        "ps-change": policy("ps-change"),
        "ps-write": policy("ps-write", execution__require_approval_for=["persistent_write"]),
        "ps-phantom": phantom_policy(),
        # the seed policy's shape: a kernel-bounded workspace (an ext4 image, diskfs.py)
        "ps-img": policy("ps-img", sandbox__workspace={**WS, "max_bytes": 8_000_000}),
        "ps-img-write": policy(
            "ps-img-write",
            sandbox__workspace={**WS, "max_bytes": 8_000_000},
            execution__require_approval_for=["persistent_write"],
        ),
    }
    with running_gateway(world, policies) as g:
        yield g


def run(
    gw: Gateway, script: str, *, policy: str, workspace: str, extra: tuple[str, ...] = (), timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    argv = gw.cmd(
        "sandbox",
        "run",
        "--config",
        str(gw.config),
        "--policy",
        policy,
        "--workspace",
        workspace,
        *extra,
        "--",
        "sh",
        "-c",
        script,
    )
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=gw.caller_env(), check=False, preexec_fn=safety_net
    )


def cli(gw: Gateway, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gw.cmd(*args, "--config", str(gw.config)), capture_output=True, text=True, timeout=60, check=False
    )


def data(gw: Gateway, name: str) -> Path:
    return gw.base / "var" / "workspaces" / name / "data"


def ws_records(gw: Gateway, name: str, action: str, at_least: int = 1) -> list[dict]:
    def mine(r: dict) -> bool:
        return (
            r.get("egressgate.operation") == "workspace"
            and r.get("egressgate.workspace.name") == name
            and r.get("egressgate.workspace.action") == action
        )

    deadline = time.monotonic() + 15
    while True:
        found = [r for r in gw.records() if mine(r)]
        if len(found) >= at_least or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def strings(value: Any) -> list[str]:
    """An OTLP arrayValue attribute, flattened by the test launcher, as plain strings."""
    return [next(iter(v.values())) for v in (value or {}).get("values", [])]


def ok(res: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert res.returncode == 0, res.stdout + res.stderr
    return res


# ------------------------------------------------------------------------------------------------ item 5


def test_only_save_paths_survive_and_the_manifest_is_audited(gw: Gateway) -> None:
    ok(
        run(
            gw,
            "mkdir -p /workspace/src /workspace/results; echo code > /workspace/src/app.py; "
            "echo sk-live > /workspace/src/.credentials; echo r > /workspace/results/out.txt; "
            "echo junk > /workspace/scratch.txt; echo 'curl evil' > /workspace/.bash_history",
            policy="ps-keep",
            workspace="sel",
        )
    )
    kept = sorted(manifest.scan(data(gw, "sel")))
    assert kept == ["results", "results/out.txt", "src", "src/app.py"]
    saved = ws_records(gw, "sel", "saved")[-1]
    assert saved["egressgate.workspace.manifest_hash"] == manifest.manifest_hash(manifest.scan(data(gw, "sel")))
    assert sorted(strings(saved["egressgate.workspace.removed"])) == [
        ".bash_history",
        "scratch.txt",
        "src/.credentials",
    ]
    # positive control: the next run sees what was saved, and nothing else
    second = ok(run(gw, "cat /workspace/src/app.py; ls -A /workspace", policy="ps-keep", workspace="sel"))
    assert second.stdout.split() == ["code", "results", "src"]
    listing = json.loads(ok(cli(gw, "workspaces", "list", "--format", "json")).stdout)
    assert any(w["workspace"] == "sel" and w["entries"] == 4 for w in listing["workspaces"])
    ok(cli(gw, "workspaces", "rm", "sel"))  # recorded through the gateway, then removed
    assert not (gw.base / "var" / "workspaces" / "sel").exists()
    assert ws_records(gw, "sel", "removed")


def test_a_workspace_changed_between_runs_is_refused_then_accepted(gw: Gateway) -> None:
    ok(run(gw, "mkdir -p /workspace/src; echo v1 > /workspace/src/tool.py", policy="ps-keep", workspace="tamper"))
    untouched = ok(run(gw, "cat /workspace/src/tool.py", policy="ps-keep", workspace="tamper"))  # positive control
    assert untouched.stdout.strip() == "v1"
    restored = ws_records(gw, "tamper", "restored", at_least=2)[-1]
    assert restored["egressgate.workspace.verified"] is True

    (data(gw, "tamper") / "src" / "tool.py").write_text("import os; os.system('exfiltrate')\n")  # outside a run
    refused = run(gw, "mkdir -p /workspace/results; touch /workspace/results/ran", policy="ps-keep", workspace="tamper")
    assert refused.returncode == 120, refused.stdout + refused.stderr
    assert "changed outside a run" in refused.stderr and "src/tool.py" in refused.stderr
    assert not (data(gw, "tamper") / "results" / "ran").exists()  # the workload never started
    record = ws_records(gw, "tamper", "restore_refused")[-1]
    assert record["egressgate.decision"] == "deny" and record["egressgate.reason"] == "workspace_changed"
    assert strings(record["egressgate.workspace.changed"]) == ["src/tool.py"]

    accepted = ok(
        run(gw, "cat /workspace/src/tool.py", policy="ps-keep", workspace="tamper", extra=("--accept-changes",))
    )
    assert "exfiltrate" in accepted.stdout
    record = ws_records(gw, "tamper", "changes_accepted")[-1]
    assert record["egressgate.workspace.accepted_by"] and record["egressgate.decision"] == "allow"
    # accepted once: the next run restores without it
    ok(run(gw, "true", policy="ps-keep", workspace="tamper"))


def test_a_restore_after_a_policy_change_names_both_hashes(gw: Gateway) -> None:
    """The new policy also stops saving /workspace/results: the restore applies it to what is there."""
    ok(
        run(
            gw,
            "mkdir -p /workspace/src /workspace/results; echo x > /workspace/src/a; echo r > /workspace/results/r",
            policy="ps-change",
            workspace="pchange",
        )
    )
    old_hash = ws_records(gw, "pchange", "saved")[-1]["egressgate.policy.hash"]
    ok(run(gw, "test -e /workspace/results/r", policy="ps-change", workspace="pchange"))  # positive control
    same = ws_records(gw, "pchange", "restored", at_least=2)[-1]
    assert same["egressgate.workspace.policy_changed"] is False

    changed = policy("ps-change")
    changed["network"]["dns"]["allow"] = ["api.allowed.test", "other.allowed.test"]
    changed["persistence"]["save"] = ["/workspace/src"]
    (gw.base / "policies" / "ps-change.yaml").write_text(yaml.safe_dump(changed, sort_keys=False))

    def reloads() -> int:
        return len([r for r in gw.records() if r.get("egressgate.operation") == "policy_reload"])

    before = reloads()
    gw.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while reloads() <= before and time.monotonic() < deadline:
        time.sleep(0.1)

    ok(run(gw, "test ! -e /workspace/results && cat /workspace/src/a", policy="ps-change", workspace="pchange"))
    record = ws_records(gw, "pchange", "restored", at_least=3)[-1]
    assert record["egressgate.workspace.previous_policy_hash"] == old_hash
    assert record["egressgate.workspace.policy_hash"] == record["egressgate.policy.hash"] != old_hash
    assert record["egressgate.workspace.policy_changed"] is True
    assert strings(record["egressgate.workspace.removed_at_restore"]) == ["results"]


def test_the_previous_runs_token_is_refused_after_a_restore(gw: Gateway) -> None:
    first = ok(
        run(
            gw,
            'mkdir -p /workspace/results; echo "$HTTP_PROXY" > /workspace/results/old-proxy',
            policy="ps-keep",
            workspace="creds",
        )
    )
    old_sid = sandbox_id(first.stderr)
    second = ok(
        run(
            gw,
            'curl -s -o /dev/null -w "%{http_code}\\n" --max-time 10 '
            '-x "$(cat /workspace/results/old-proxy)" https://api.allowed.test/; '
            'curl -s -o /dev/null -w "%{http_code}\\n" --max-time 10 https://api.allowed.test/',
            policy="ps-keep",
            workspace="creds",
        )
    )
    old, new = second.stdout.split()
    assert old in ("407", "000"), second.stdout  # curl shows a refused CONNECT as 000
    assert new == "200", second.stdout  # positive control: the reissued token works
    record = ws_records(gw, "creds", "restored", at_least=2)[-1]
    assert record["egressgate.workspace.previous_sandbox"] == old_sid
    assert record["egressgate.workspace.previous_sandbox_revoked"] is True
    assert record["egressgate.workspace.sandbox_id"] == sandbox_id(second.stderr) != old_sid


def test_a_restore_reissues_the_phantom_credential_and_the_old_one_is_worthless(gw: Gateway) -> None:
    """The phantom the previous run saved in its workspace is not the new run's, and with the old run's
    identity it gets nowhere (407); the new identity works (positive control)."""
    ok(
        run(
            gw,
            'mkdir -p /workspace/results; echo "$EGN_KEY" > /workspace/results/old-key; '
            'echo "$HTTP_PROXY" > /workspace/results/old-proxy',
            policy="ps-phantom",
            workspace="phantom",
        )
    )
    r = "/workspace/results"
    second = ok(
        run(
            gw,
            f'test -n "$EGN_KEY" && test "$EGN_KEY" != "$(cat {r}/old-key)" && echo new; '
            f'curl -s -o /dev/null -w "%{{http_code}}\\n" --max-time 10 -H "x-api-key: $(cat {r}/old-key)" '
            f'-x "$(cat {r}/old-proxy)" https://api.allowed.test/; '
            'curl -s -o /dev/null -w "%{http_code}\\n" --max-time 10 https://api.allowed.test/',
            policy="ps-phantom",
            workspace="phantom",
        )
    )
    fresh, old, new = second.stdout.split()
    assert fresh == "new" and old in ("407", "000") and new == "200", second.stdout + second.stderr


def test_a_previous_sandbox_still_admitted_is_revoked_by_the_restore(gw: Gateway) -> None:
    """A run whose revocation never happened (gateway down at its end): its sandbox must not outlive the
    restore. The workspace record is made to name a live sandbox."""
    ok(run(gw, "mkdir -p /workspace/src", policy="ps-keep", workspace="stale"))
    admitted = json.loads(ok(cli(gw, "sandbox", "admit", "--policy", "ps-keep")).stdout)
    state_file = gw.base / "var" / "workspaces" / "stale" / "state.json"
    state = json.loads(state_file.read_text())
    state["sandbox_id"] = admitted["id"]
    state_file.write_text(json.dumps(state))
    shown = json.loads(ok(cli(gw, "sandbox", "show", admitted["id"])).stdout)
    assert shown["revoked"] is False  # positive control: live before the restore
    ok(run(gw, "true", policy="ps-keep", workspace="stale"))
    assert json.loads(ok(cli(gw, "sandbox", "show", admitted["id"])).stdout)["revoked"] is True
    record = ws_records(gw, "stale", "restored", at_least=2)[-1]
    assert record["egressgate.workspace.previous_sandbox_revoked_now"] is True


def test_a_package_the_last_run_installed_is_named_at_restore(gw: Gateway) -> None:
    ok(
        run(
            gw,
            "mkdir -p /workspace/src; echo 'requests==2.32.0' > /workspace/src/requirements.txt",
            policy="ps-keep",
            workspace="deps",
        )
    )
    ok(
        run(
            gw,
            "d=/workspace/src/.venv/lib/python3.11/site-packages; mkdir -p $d/evil_pkg-0.1.dist-info; "
            "echo 'requests==2.32.0' > /workspace/src/requirements.txt",
            policy="ps-keep",
            workspace="deps",
        )
    )
    ok(run(gw, "true", policy="ps-keep", workspace="deps"))
    records = ws_records(gw, "deps", "restored", at_least=3)
    first, second, third = records[-3:]
    assert strings(first.get("egressgate.workspace.deps.added")) == []  # nothing before the first run
    assert strings(second.get("egressgate.workspace.deps.added")) == ["file:src/requirements.txt"]
    assert strings(third["egressgate.workspace.deps.added"]) == ["pypi:src/.venv/lib/python3.11/site-packages:evil-pkg"]
    assert third["egressgate.workspace.deps.changed_count"] in (0, "0")  # the same requirements file


# ------------------------------------------------------------------------------------------------ item 4


def pending_write(res: subprocess.CompletedProcess[str]) -> str:
    ok(res)
    for word in res.stderr.split():
        if word.startswith("apr-"):
            return word.rstrip(")").rstrip(";")
    raise AssertionError(f"no approval in: {res.stderr}")


def approval(gw: Gateway, approval_id: str) -> dict:
    return json.loads(ok(cli(gw, "approvals", "show", approval_id)).stdout)


def test_an_approved_write_is_applied_with_every_path_listed(gw: Gateway) -> None:
    apr = pending_write(
        run(gw, "mkdir -p /workspace/src; printf hello > /workspace/src/new.txt", policy="ps-write", workspace="w-ok")
    )
    assert not (data(gw, "w-ok") / "src").exists()  # staged, not applied
    shown = approval(gw, apr)
    assert shown["kind"] == "persistent_write" and shown["state"] == "pending"
    changes = {c["path"]: c for c in shown["details"]["changes"]}
    assert set(changes) == {"src", "src/new.txt"}
    assert changes["src/new.txt"]["size"] == 5
    assert changes["src/new.txt"]["sha256"] == hashlib.sha256(b"hello").hexdigest()
    assert apr in ok(cli(gw, "approvals", "list")).stdout

    ok(cli(gw, "approvals", "approve", apr))
    deadline = time.monotonic() + 15
    while not (data(gw, "w-ok") / "src" / "new.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (data(gw, "w-ok") / "src" / "new.txt").read_text() == "hello"
    applied = ws_records(gw, "w-ok", "write_applied")[-1]
    assert applied["egressgate.workspace.approval_id"] == apr
    # the applied content is the workspace now: the next run restores it (its manifest verified)
    assert ok(run(gw, "cat /workspace/src/new.txt", policy="ps-write", workspace="w-ok")).stdout == "hello"


def test_a_denied_write_is_discarded_and_a_pending_one_blocks_the_next_run(gw: Gateway) -> None:
    ok(run(gw, "true", policy="ps-write", workspace="w-deny"))  # an empty workspace: nothing to approve
    apr = pending_write(
        run(gw, "mkdir -p /workspace/src; echo bad > /workspace/src/bad.txt", policy="ps-write", workspace="w-deny")
    )
    blocked = run(gw, "true", policy="ps-write", workspace="w-deny")
    assert blocked.returncode == 120 and apr in blocked.stderr, blocked.stderr
    ok(cli(gw, "approvals", "deny", apr))
    record = ws_records(gw, "w-deny", "write_discarded")[-1]
    assert record["egressgate.workspace.outcome"] == "denied"
    assert not (data(gw, "w-deny") / "src").exists()
    assert not list((gw.base / "var" / "workspaces" / "w-deny" / "staged").glob("*"))
    ok(run(gw, "test ! -e /workspace/src/bad.txt", policy="ps-write", workspace="w-deny"))  # unblocked


def test_an_expired_write_is_discarded(gw: Gateway) -> None:
    apr = pending_write(
        run(
            gw,
            "mkdir -p /workspace/src; echo late > /workspace/src/late.txt",
            policy="ps-write",
            workspace="w-exp",
            extra=("--approval-ttl", "2"),
        )
    )
    record = ws_records(gw, "w-exp", "write_discarded")
    assert record and record[-1]["egressgate.workspace.outcome"] == "expired"
    assert approval(gw, apr)["state"] == "expired"
    assert not (data(gw, "w-exp") / "src").exists()


def test_a_bounded_workspace_image_is_saved_restored_and_staged(gw: Gateway) -> None:
    """With max_bytes the content lives in an ext4 image: the selection, the manifest and the restore work
    on the mounted content; a staged write copies the (sparse) image and is swapped in whole."""
    ok(
        run(
            gw,
            "mkdir -p /workspace/src; echo a > /workspace/src/a; echo junk > /workspace/junk",
            policy="ps-img",
            workspace="img",
        )
    )
    assert [p.name for p in data(gw, "img").iterdir()] == [".egressgate-workspace.ext4"]
    # another process's cloned mount namespace may hold the unmounted image a while (runs.loops_freed)
    assert loops_freed(data(gw, "img") / ".egressgate-workspace.ext4") == []
    second = ok(
        run(gw, "cat /workspace/src/a; test ! -e /workspace/junk && echo gone", policy="ps-img", workspace="img")
    )
    assert second.stdout.split() == ["a", "gone"]
    assert ws_records(gw, "img", "restored", at_least=2)[-1]["egressgate.workspace.verified"] is True

    apr = pending_write(
        run(gw, "mkdir -p /workspace/src; echo b > /workspace/src/b", policy="ps-img-write", workspace="img-w")
    )
    assert {c["path"] for c in approval(gw, apr)["details"]["changes"]} == {"src", "src/b"}
    ok(cli(gw, "approvals", "approve", apr))
    ws_records(gw, "img-w", "write_applied")
    assert ok(run(gw, "cat /workspace/src/b", policy="ps-img-write", workspace="img-w")).stdout.strip() == "b"


def test_a_killed_run_leaves_no_bind_mount_and_its_changes_need_an_operator(gw: Gateway) -> None:
    """SIGKILL of `sandbox run` and its watchdog mid-run: `sandbox gc` unmounts the named workspace's bind
    (recorded before it existed), the workspace lock dies with the process, and the changes the killed run
    made (never saved, no manifest) make the next restore refuse until an operator accepts them."""
    from egressgate.runtimes.diskfs import mounted
    from tests.runtimes.runs import kill_watchdog, wait_for_workload

    ok(run(gw, "mkdir -p /workspace/src; echo v1 > /workspace/src/a", policy="ps-keep", workspace="killed"))
    argv = gw.cmd(
        "sandbox",
        "run",
        "--config",
        str(gw.config),
        "--policy",
        "ps-keep",
        "--workspace",
        "killed",
        "--",
        "sh",
        "-c",
        "echo v2 > /workspace/src/a; exec sleep 60",
    )
    proc = subprocess.Popen(
        argv, text=True, env=gw.caller_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=safety_net
    )
    record = wait_for_workload(gw, proc)
    target = gw.state_dir / "workspaces" / record["run_id"]
    assert mounted(target) is not None  # positive control: the bind exists while the run does
    kill_watchdog(record)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert mounted(target) is not None  # the kill left it behind
    gc = subprocess.run(
        gw.cmd("sandbox", "gc", "--config", str(gw.config)), capture_output=True, text=True, timeout=120, check=False
    )
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert mounted(target) is None and not target.exists()
    refused = run(gw, "cat /workspace/src/a", policy="ps-keep", workspace="killed")
    assert refused.returncode == 120 and "src/a" in refused.stderr, refused.stderr
    accepted = ok(run(gw, "cat /workspace/src/a", policy="ps-keep", workspace="killed", extra=("--accept-changes",)))
    assert accepted.stdout.strip() == "v2"


def test_a_host_directory_workspace_is_persisted_verified_and_staged(gw: Gateway) -> None:
    """`--workspace /some/dir` (a path) keeps its content where the operator put it; its bookkeeping lives in
    var/workspaces/.paths; a staged write is copied next to it (same file system) and swapped in on approval."""
    from tests.runtimes.harness import base_dir, remove

    parent = base_dir("/var/tmp")
    try:
        host = parent / "work"
        ok(
            run(
                gw,
                "mkdir -p /workspace/src; echo a > /workspace/src/a; echo j > /workspace/junk",
                policy="ps-keep",
                workspace=str(host),
            )
        )
        assert sorted(p.name for p in host.iterdir()) == ["src"]
        assert list((gw.base / "var" / "workspaces" / ".paths").glob("*/state.json"))
        (host / "src" / "a").write_text("tampered\n")
        refused = run(gw, "true", policy="ps-keep", workspace=str(host))
        assert refused.returncode == 120 and "changed outside a run" in refused.stderr, refused.stderr
        ok(run(gw, "true", policy="ps-keep", workspace=str(host), extra=("--accept-changes",)))

        apr = pending_write(run(gw, "echo b > /workspace/src/b", policy="ps-write", workspace=str(host)))
        staged = list(parent.glob(".work.egressgate-staged.*"))
        assert len(staged) == 1 and (staged[0] / "src" / "b").exists() and not (host / "src" / "b").exists()
        ok(cli(gw, "approvals", "approve", apr))
        ws_records(gw, str(host), "write_applied")
        assert (host / "src" / "b").read_text() == "b\n" and not list(parent.glob(".work.egressgate-staged.*"))
    finally:
        remove(parent)


def test_an_approval_the_gateway_could_not_apply_is_applied_by_the_next_run(gw: Gateway) -> None:
    """Another host's gateway (or one without permission on the var dir) decides the approval but cannot
    find the staged copy: the next `sandbox run` on the workspace asks the gateway, applies it and records it."""
    apr = pending_write(
        run(gw, "mkdir -p /workspace/src; echo lazy > /workspace/src/l", policy="ps-write", workspace="w-lazy")
    )
    state_file = gw.base / "var" / "workspaces" / "w-lazy" / "state.json"
    kept = state_file.read_text()
    hidden = json.loads(kept)
    hidden["pending"]["approval_id"] = "apr-0000000000000000"  # the gateway looks for `apr` and finds nothing
    state_file.write_text(json.dumps(hidden))
    ok(cli(gw, "approvals", "approve", apr))  # the gateway settles before it answers
    assert not (data(gw, "w-lazy") / "src").exists()  # not applied by the gateway
    state_file.write_text(kept)
    assert ok(run(gw, "cat /workspace/src/l", policy="ps-write", workspace="w-lazy")).stdout.strip() == "lazy"
    applied = ws_records(gw, "w-lazy", "write_applied")[-1]
    assert applied["egressgate.workspace.approval_id"] == apr and applied["egressgate.workspace.outcome"] == "approved"


def test_the_trail_with_workspace_records_verifies_replays_and_indexes(gw: Gateway) -> None:
    """The new `workspace` records are ordinary chain members: `audit verify` accepts the trail, `audit replay`
    and `audit index` read past them (replay re-decides only requests; the policies changed mid-module, so a
    changed decision is exit 1, never a crash)."""
    ok(run(gw, "true", policy="ps-keep", workspace="trail"))
    assert ws_records(gw, "trail", "saved")
    audit = str(gw.audit_path)
    verify = subprocess.run(
        gw.cmd("audit", "verify", "--allow-unsealed", audit), capture_output=True, text=True, timeout=120, check=False
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    replay = subprocess.run(
        gw.cmd("audit", "replay", audit, "--policy", str(gw.base / "policies")),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert replay.returncode in (0, 1) and "Traceback" not in replay.stderr, replay.stdout + replay.stderr
    index = subprocess.run(gw.cmd("audit", "index", audit), capture_output=True, text=True, timeout=120, check=False)
    assert index.returncode == 0, index.stdout + index.stderr
