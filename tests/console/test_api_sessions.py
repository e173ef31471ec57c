"""Console sessions on disk: what one worker process creates another honours, logout anywhere ends it,
expired sessions are refused and purged, ids are never stored; the login limiter's window."""

from __future__ import annotations

import os
import stat

from egressgate.admin.ui.auth import (
    LOGIN_FAILURES_MAX,
    LOGIN_WINDOW_S,
    SESSION_SECONDS,
    LoginLimiter,
    SessionStore,
    ensure_role_tokens,
    host_allowed,
    match_token,
)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_two_processes_share_sessions_and_logout_ends_them_everywhere(tmp_path):
    clock = Clock()
    worker1, worker2 = SessionStore(tmp_path / "s", clock), SessionStore(tmp_path / "s", clock)
    sid, session = worker1.create("auditor")
    assert worker2.get(sid) == session  # a request answered by another worker
    assert all(sid not in p.name and sid not in p.read_text() for p in (tmp_path / "s").iterdir())
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o700
    worker2.delete(sid)
    assert worker1.get(sid) is None
    assert worker1.get("x" * 43) is None and worker1.get(None) is None and worker1.get("y" * 500) is None


def test_sessions_expire_after_8_hours_and_are_purged(tmp_path):
    clock = Clock()
    store = SessionStore(tmp_path / "s", clock)
    old, _ = store.create("operator")
    clock.now += SESSION_SECONDS - 1
    assert store.get(old) is not None
    clock.now += 2
    assert store.get(old) is None
    stale, _ = store.create("operator")
    clock.now += SESSION_SECONDS + 1
    store.create("auditor")  # a login purges expired sessions
    assert len(list((tmp_path / "s").iterdir())) == 1 and store.get(stale) is None


def test_the_store_is_bounded_and_ends_the_oldest_sessions(tmp_path, monkeypatch):
    monkeypatch.setattr("egressgate.admin.ui.auth.MAX_SESSIONS", 3)
    clock = Clock()
    store = SessionStore(tmp_path / "s", clock)
    ids = []
    for _ in range(5):
        clock.now += 1
        ids.append(store.create("auditor")[0])
    assert len(list((tmp_path / "s").iterdir())) == 3
    assert [store.get(i) is not None for i in ids] == [False, False, True, True, True]


def test_a_tampered_session_file_grants_nothing(tmp_path):
    store = SessionStore(tmp_path / "s", Clock())
    sid, _ = store.create("auditor")
    (path,) = (tmp_path / "s").iterdir()
    path.write_text('{"role": "root", "csrf": "x", "expires": 9e18}')
    assert store.get(sid) is None and not path.exists()


def test_login_limiter_window(tmp_path):
    clock = Clock()
    limiter = LoginLimiter(clock)
    for _ in range(LOGIN_FAILURES_MAX):
        assert not limiter.blocked("127.0.0.9")
        limiter.failed("127.0.0.9")
    assert limiter.blocked("127.0.0.9") and not limiter.blocked("127.0.0.10")
    clock.now += LOGIN_WINDOW_S + 0.1
    assert not limiter.blocked("127.0.0.9")


def test_role_tokens_and_matching(tmp_path):
    tokens = ensure_role_tokens(tmp_path)
    assert ensure_role_tokens(tmp_path) == tokens  # created once, then read
    assert match_token(tokens, tokens["operator"]) == "operator"
    assert match_token(tokens, tokens["auditor"]) == "auditor"
    for wrong in (tokens["operator"][:-1], tokens["operator"] + "x", "", None, 42, "a" * 1000):
        assert match_token(tokens, wrong) is None


def test_host_allowed():
    for ok in ("127.0.0.1:8081", "127.0.0.1", "[::1]:8081", "[::1]", "localhost:8081", "LOCALHOST", "10.0.0.5:80"):
        assert host_allowed(ok), ok
    for bad in ("evil.example:8081", "evil.example", "127.0.0.1.nip.io:8081", "[::1", "localhost.evil:1", ""):
        assert not host_allowed(bad), bad
