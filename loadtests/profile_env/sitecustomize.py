"""cProfile in every Python process started with this directory on PYTHONPATH and EGB_CPROFILE_DIR set.

Why: `egressgate run --workers N` starts its workers itself (`python -c ...`), so a wrapper around the
command profiles only the supervisor. A sitecustomize module runs at every interpreter start-up, workers
included (they inherit the environment). Profiling is off until SIGUSR1 and off again at SIGUSR2 (only
the load is profiled); the stats are written to EGB_CPROFILE_DIR/<pid>.prof when the process exits
normally (SIGTERM stops a gateway and its workers cleanly). Used by `state_bench --profile`; nothing
happens in a process without EGB_CPROFILE_DIR.
"""

import os

if os.environ.get("EGB_CPROFILE_DIR"):
    import atexit
    import cProfile
    import signal

    _prof = cProfile.Profile()
    _out = os.path.join(os.environ["EGB_CPROFILE_DIR"], f"{os.getpid()}.prof")
    _on = [False]

    def _enable(*_a) -> None:
        _on[0] = True
        _prof.enable()

    signal.signal(signal.SIGUSR1, _enable)
    signal.signal(signal.SIGUSR2, lambda *_a: _prof.disable())
    atexit.register(lambda: (_prof.disable(), _prof.dump_stats(_out)) if _on[0] else None)
