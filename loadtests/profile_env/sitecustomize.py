"""cProfile in every Python process started with this directory on PYTHONPATH and EGB_CPROFILE_DIR set.

Why: `egressgate run --workers N` starts its workers itself (forked from the supervisor), so a wrapper
around the command profiles only the supervisor. A sitecustomize module runs at every interpreter start-up
(the supervisor's); a forked worker inherits its handlers and gets a profiler and stats file of its own
(os.register_at_fork), dumped by the atexit handler a worker runs when it ends (gateway/service/forking.py).
Profiling is off until SIGUSR1 and off again at SIGUSR2 (only
the load is profiled); the stats are written to EGB_CPROFILE_DIR/<pid>.prof when the process exits
normally (SIGTERM stops a gateway and its workers cleanly). Used by `state_bench --profile`; nothing
happens in a process without EGB_CPROFILE_DIR.
"""

import os

if os.environ.get("EGB_CPROFILE_DIR"):
    import atexit
    import cProfile
    import signal

    _state: dict = {}

    def _fresh() -> None:
        """This process's own profiler, off, and its own stats file (also in a forked child)."""
        _state.update(prof=cProfile.Profile(), on=False,
                      out=os.path.join(os.environ["EGB_CPROFILE_DIR"], f"{os.getpid()}.prof"))

    def _enable(*_a) -> None:
        _state["on"] = True
        _state["prof"].enable()

    def _dump() -> None:
        if _state["on"]:
            _state["prof"].disable()
            _state["prof"].dump_stats(_state["out"])

    _fresh()
    os.register_at_fork(after_in_child=_fresh)
    signal.signal(signal.SIGUSR1, _enable)
    signal.signal(signal.SIGUSR2, lambda *_a: _state["prof"].disable())
    atexit.register(_dump)
