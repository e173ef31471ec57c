"""The end of a `sandbox run` (runtimes/run.py): teardown in a fixed order, then revocation with the outcome.

Why a fixed order and no early exit: every step must run whatever failed before it, because each one
frees a different host object (processes, namespace, cgroups, mounts, uid) and a skipped step would leave
it behind. A failed step only marks the teardown unclean: the run record stays, and the watchdog or
`sandbox gc` retries from it. The record goes last, and only after a clean teardown and revocation.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from egressgate.runtimes import records
from egressgate.runtimes.base import EXIT_SETUP_FAILED, ExitInfo
from egressgate.runtimes.workload import SetupFailed

if TYPE_CHECKING:
    from egressgate.runtimes.run import Run


def end_run(run: Run, exit_info: ExitInfo | None, duration_ms: int) -> int:
    """Tear the run down, revoke its sandbox with the outcome, and return the process exit code."""
    from egressgate.runtimes.run import TIMING, log

    clean = True
    dropped: dict[str, int] = {}
    if run.signal is not None and exit_info is not None and exit_info.limit is None:
        exit_info = ExitInfo(status=None, signal=run.signal)

    def release() -> None:
        """After the kills, before the adapter removes the namespace: the drop counters (final now)
        while the veth deletion runs (plumbing.release); a failure only loses the counters."""
        nonlocal dropped
        if run.plumbing is not None:
            with contextlib.suppress(Exception):
                dropped = run.plumbing.release()

    setid: list[str] = []

    def strip_setid_bits() -> None:
        """Before the workspace goes back to root (t_identity): that chown clears set-id bits too, but
        silently; this strip reports what it found (audited as egressgate.run.setid_stripped)."""
        nonlocal setid
        if run.temp_workspace is None and run.workspace is not None and run.started:
            from egressgate.runtimes.setid import MAX_REPORTED, strip_setid

            found = strip_setid(run.workspace)
            if found:
                log(f"stripped set-id bits from {len(found)} file(s) in the workspace: {', '.join(found[:5])}")
            setid = found[:MAX_REPORTED]

    # the set-id strip and the give-back to root work on the workspace's content, which for a bounded
    # workspace is the mounted file system (diskfs.py): both before t_disks unmounts it
    for name, step in (("t_watch", lambda: run.watch and run.watch.stop()),
                       ("t_kill", lambda: run.adapter and run.adapter.kill()),
                       ("t_killall", lambda: run.limits and run.limits.kill_all()),
                       ("counters", release),
                       ("t_adapter", lambda: run.adapter and run.adapter.teardown()),
                       ("t_plumbing", lambda: run.plumbing and run.plumbing.detach()),
                       ("t_limits", lambda: run.limits and run.limits.remove()),
                       ("t_setid", strip_setid_bits),
                       ("t_identity", lambda: release_identity(run)),
                       ("t_persist", lambda: run.persist and run.persist.save(run.started)),
                       ("t_disks", lambda: run.disks and run.disks.release()),
                       ("t_unlock", lambda: run.persist and run.persist.finish())):
        try:
            step()
            run.mark(name)
        except Exception as exc:
            clean = False
            log(f"teardown step failed ({type(exc).__name__}: {exc}); `egressgate sandbox gc` will retry")
    if run.temp_workspace is not None:  # after t_disks: its tmpfs is unmounted
        import shutil

        shutil.rmtree(run.temp_workspace, ignore_errors=True)
    code = exit_info.exit_code() if exit_info is not None else EXIT_SETUP_FAILED
    if exit_info is None and run.signal is not None:
        code = 128 + run.signal
    if run.sandbox_id is not None:
        outcome: dict[str, Any] = {
            "runtime": run.req.runtime, "exit_code": code,
            "status": exit_info.status if exit_info else None,
            "signal": exit_info.signal if exit_info else run.signal,
            "limit": str(exit_info.limit) if exit_info and exit_info.limit else None,
            "duration_ms": duration_ms, "dropped": dropped}
        if setid:
            outcome["setid_stripped"] = setid
        if getattr(run.adapter, "accel", None):  # microvm: kvm | tcg (TCG is no hardware isolation)
            outcome["accel"] = run.adapter.accel
        run.mark("teardown")
        revoked = revoke(run, outcome)
        run.mark("revoke")
        clean = clean and revoked
        what = f"limit {exit_info.limit}" if exit_info and exit_info.limit else f"exit {code}"
        log(f"sandbox {run.sandbox_id} ended ({what}){' and was revoked' if revoked else ''}; "
            f"audit records: {run.info.audit_file if run.info else '?'}")
    if run.info is not None and clean:
        with contextlib.suppress(OSError):
            records.remove(run.info.state_dir, run.run_id)
    if run.lock_fd is not None and (clean or run.info is None):  # unclean: gc retries from the record, and
        from egressgate.runtimes import runlock  # the lock ends with this process and the watchdog

        runlock.release(run.run_id, run.lock_fd)
    if TIMING:
        run.mark("end")
        pairs = zip(run._marks, run._marks[1:], strict=False)
        phases = [f"{name}={(t - prev) * 1000:.1f}" for (_, prev), (name, t) in pairs]
        log("timing ms: " + " ".join(phases))
    return code


def release_identity(run: Run) -> None:
    """The run's uid is free once its record goes: every process of it killed (whatever escaped the
    namespace and cgroups) and the persistent workspace's files given to root, so the next run given
    this uid cannot read them."""
    if run.uid is None:
        return
    from egressgate.runtimes.identity import kill_uid
    from egressgate.runtimes.workload import release_workspace

    kill_uid(run.uid)
    if run.workspace is not None:
        release_workspace(run.workspace, run.uid)


def revoke(run: Run, outcome: dict[str, Any]) -> bool:
    """Revoke with the outcome; a gateway that refuses the outcome body (older version) still gets a
    plain revocation: the sandbox's authority must end with the run whatever the record says."""
    from egressgate.runtimes.run import log

    path = f"/v1/sandboxes/{run.sandbox_id}"
    for body in ({"outcome": outcome}, None):
        try:
            status, data = run._admin("DELETE", path, body)
        except SetupFailed as exc:
            log(f"revocation of {run.sandbox_id} failed: {exc}; `egressgate sandbox gc` retries it")
            return False
        if status == 200:
            return True
        log(f"revocation of {run.sandbox_id} answered {status}: {data}")
        if status != 400:
            return False
    return False
