"""`egressgate run --workers N` (egressgate/gateway/service/workers.py): the refusal on the memory backend,
`--workers 1` unchanged, and the supervisor's mechanics (shared listeners, per-worker audit files, SIGHUP/SIGTERM
fan-out, restart of a killed worker, workers dying with the supervisor, a worker that cannot start). The
mechanics run the unmodified CLI on one module-scoped Redis (each run its own key prefix), forked from the
test fork server like every other gateway start; these tests admit no sandbox, the shared-state behaviour is
tested in tests/state_redis/test_workers.py. How a worker is forked: tests/gateway/test_worker_fork.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from dnslib import RCODE, DNSRecord

from egressgate.gateway.service.varlock import LOCK_NAME
from tests.support import cli, zygote
from tests.support.cli import POLICIES
from tests.support.env import free_port
from tests.support.launcher import EGRESSGATE, audit_records, drain, first_line, stop_process
from tests.support.procs import alive, children
from tests.support.redis import RedisServer
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("sup-redis")) as server:
        yield server


def shared(redis: RedisServer) -> dict:
    """The state store several workers need (`run` refuses --workers N on the memory backend)."""
    return {"state": {"backend": "redis", "url": redis.url, "key_prefix": redis.prefix()}}


def config(tmp: Path, **extra) -> Path:
    cfg = tmp / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": "127.0.0.1:0", "transparent": "127.0.0.2:0"},
        "policy": str(POLICIES), "var_dir": str(tmp / "var"), "dns": {"upstreams": ["127.0.0.1:9"]}, **extra}))
    return cfg


class Run:
    """A `run` process: its startup line (or None), its stderr file."""

    def __init__(self, tmp: Path, cfg: Path, *args: str) -> None:
        self.err_path = tmp / "run.stderr"
        err = open(self.err_path, "w")  # noqa: SIM115 - lives with the process
        # the console script, forked from the test fork server (zygote.py)
        self.proc = zygote.popen([EGRESSGATE, "run", "--config", str(cfg), *args],
                                 stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "NO_PROXY": ""})
        line = first_line(self.proc, 60)
        self.info = json.loads(line) if line.strip() else None
        drain(self.proc)

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for run in started:
        workers = children(run.proc.pid) | set((run.info or {}).get("workers", []))
        stop_process(run.proc)
        for pid in workers:  # never left behind by a failing test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_workers_refused_with_the_memory_backend(tmp_path, runs):
    """The unmodified CLI: --workers 2 on the (default) memory backend stops before binding anything,
    with what to do; the positive control is --workers 1 on the same config serving."""
    port = free_port()
    cfg = config(tmp_path, listen={"proxy": f"127.0.0.1:{port}", "admin": "127.0.0.1:0", "dns": None,
                                   "transparent": None})
    res = cli.run([EGRESSGATE, "run", "--config", str(cfg), "--workers", "2"], timeout=60)
    assert res.returncode != 0 and res.stdout == ""
    assert "--workers 2 needs a shared state store" in res.stderr and "backend: redis" in res.stderr, res.stderr
    assert not (tmp_path / "var" / "gateway.json").exists()
    with socket.socket() as s:  # nothing was bound
        s.bind(("127.0.0.1", port))
    runs.append(run := Run(tmp_path, cfg, "--workers", "1"))
    assert run.info is not None and run.info["proxy"] == f"127.0.0.1:{port}", run.stderr()


def test_one_worker_is_the_gateway_itself(tmp_path, runs):
    """--workers 1 (the default) is today's gateway: no supervisor, no child process, audit.jsonl, the
    runtime file names the process itself."""
    runs.append(run := Run(tmp_path, config(tmp_path), "--workers", "1"))
    assert run.info is not None, run.stderr()
    assert "workers" not in run.info
    runtime = json.loads((tmp_path / "var" / "gateway.json").read_text())
    assert runtime["pid"] == run.proc.pid and runtime["proxy"] == run.info["proxy"]
    assert runtime["audit_file"] == str((tmp_path / "var" / "audit.jsonl").absolute())
    assert children(run.proc.pid) == set()
    assert (tmp_path / "var" / "audit.jsonl").exists() and not list((tmp_path / "var").glob("audit.w*"))


def dns_rcode(dns: str, tcp: bool = False) -> int:
    host, _, port = dns.rpartition(":")
    reply = DNSRecord.question("example.test", "A").send(host, int(port), tcp=tcp, timeout=5)
    return DNSRecord.parse(reply).header.rcode


def proxy_407(proxy: str) -> bool:
    res = httpx.get("http://example.test/", proxy=f"http://{proxy}", trust_env=False, timeout=10)
    return res.status_code == 407


def test_supervisor_shares_listeners_fans_out_signals_and_restarts(tmp_path, runs, redis):
    var = tmp_path / "var"
    runs.append(run := Run(tmp_path, config(tmp_path, **shared(redis)), "--workers", "2"))
    assert run.info is not None, run.stderr()
    sup = run.proc.pid
    w0, w1 = run.info["workers"]
    assert run.info["pid"] == sup and children(sup) == {w0, w1}
    runtime = json.loads((var / "gateway.json").read_text())  # written once, by the supervisor
    assert runtime["pid"] == sup and runtime["proxy"] == run.info["proxy"]
    assert runtime["audit_file"] == str((var / "audit.w*.jsonl").absolute())
    # every listener answers on its one address: proxy, admin, DNS over UDP and TCP
    assert all(proxy_407(run.info["proxy"]) for _ in range(20))
    assert httpx.get(f"http://{run.info['admin']}/healthz", timeout=10).status_code == 200
    assert dns_rcode(run.info["dns"]) == RCODE.REFUSED and dns_rcode(run.info["dns"], tcp=True) == RCODE.REFUSED
    # each worker writes its own chain; both served the proxy port (requests recorded in both files)

    def both_served() -> bool:
        assert all(proxy_407(run.info["proxy"]) for _ in range(10))
        return all(_served(var / f"audit.w{i}.jsonl") for i in (0, 1))

    assert wait_for(both_served, timeout=30)
    assert _holds(w0, var / "audit.w0.jsonl") and _holds(w1, var / "audit.w1.jsonl")
    # forked workers (gateway/service/forking.py): each in a process group of its own, none holding the
    # supervisor's var-dir lock (control: the supervisor does); the supervisor forks from a single thread
    assert os.getpgid(w0) == w0 and os.getpgid(w1) == w1 and os.getpgid(sup) not in (w0, w1)
    assert _holds(sup, var / LOCK_NAME) and not _holds(w0, var / LOCK_NAME) and not _holds(w1, var / LOCK_NAME)
    assert os.listdir(f"/proc/{sup}/task") == [str(sup)]
    # SIGHUP to the supervisor reloads the policies in every worker
    run.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: all(f"w{i}/egressgate.gateway.service.app: policies reloaded (SIGHUP)" in run.stderr()
                                for i in (0, 1)), timeout=15), run.stderr()[-3000:]
    # kill -9 a worker: the other keeps serving at once, the supervisor starts a new one in its slot
    os.kill(w0, signal.SIGKILL)
    assert all(proxy_407(run.info["proxy"]) for _ in range(20))
    # a SIGHUP while the replacement is still starting (no handler yet: SIGHUP's default action would
    # kill it) reaches only the serving worker; the replacement comes up and reloads nothing twice
    assert wait_for(lambda: run.stderr().count("worker w0 started (pid") == 2, timeout=30), run.stderr()[-3000:]
    for _ in range(3):
        run.proc.send_signal(signal.SIGHUP)
        time.sleep(0.1)
    assert wait_for(lambda: len(children(sup) - {w1}) == 1 and "worker w0 (pid" in run.stderr()
                    and "serving again" in run.stderr(), timeout=30), run.stderr()[-3000:]
    assert "killed by SIGHUP" not in run.stderr() and run.stderr().count("worker w0 started (pid") == 2
    new_w0 = (children(sup) - {w1}).pop()
    assert new_w0 != w0 and _holds(new_w0, var / "audit.w0.jsonl")
    # SIGTERM: every worker stops gracefully (its file sealed), then the supervisor; nothing left behind
    assert stop_process(run.proc, timeout=40) == 0
    assert not alive(w1) and not alive(new_w0)
    assert not (var / "gateway.json").exists()
    files = sorted(str(p) for p in var.glob("audit*.jsonl"))
    res = cli.run([EGRESSGATE, "audit", "verify", "--per-worker", "--public-key",
                   str(var / "audit-signing.key.pub"), *files], timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "new chain" not in res.stderr  # the killed worker's successor continued its chain
    assert res.stdout.count("sealed") == len(files)  # without --allow-unsealed: every file was sealed


def _served(path: Path) -> bool:
    return path.exists() and '"identity_unknown"' in path.read_text()


def _holds(pid: int, path: Path) -> bool:
    """Process `pid` has `path` open (it is that file's one writer)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    return any(os.path.realpath(fd_dir / fd) == str(path.resolve()) for fd in os.listdir(fd_dir))


def test_workers_die_with_the_supervisor(tmp_path, runs, redis):
    """kill -9 of the supervisor: its workers get SIGTERM (PR_SET_PDEATHSIG) and stop; none is orphaned."""
    runs.append(run := Run(tmp_path, config(tmp_path, **shared(redis)), "--workers", "2"))
    assert run.info is not None, run.stderr()
    workers = set(run.info["workers"])
    assert all(alive(pid) for pid in workers)  # control
    run.proc.kill()
    run.proc.wait(10)
    assert wait_for(lambda: not any(alive(pid) for pid in workers), timeout=30)


def test_a_worker_that_cannot_start_stops_the_supervisor(tmp_path, runs, redis):
    """A failure only a worker meets (here: audit.signer vault without a Vault broker) ends `run` with the
    worker's error and exit 1; the listeners are released (the port can be bound again)."""
    port = free_port()
    cfg = config(tmp_path, audit={"signer": "vault"}, **shared(redis),
                 listen={"proxy": f"127.0.0.1:{port}", "admin": "127.0.0.1:0", "dns": None, "transparent": None})
    runs.append(run := Run(tmp_path, cfg, "--workers", "2"))
    assert run.info is None
    assert run.proc.wait(60) == 1
    err = run.stderr()
    assert "audit.signer: vault needs broker.backend: vault" in err and "did not start" in err, err[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_log_format_json_in_the_supervisor_and_every_worker(tmp_path, runs, redis):
    """`--log-format json`: every stderr line of the supervisor and of both workers is one JSON object, the
    workers' loggers carry their slot (control: the default text format is not JSON)."""
    runs.append(run := Run(tmp_path, config(tmp_path, **shared(redis)), "--workers", "2", "--log-format", "json"))
    assert run.info is not None, run.stderr()
    run.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: run.stderr().count("policies reloaded (SIGHUP)") == 2, timeout=15), run.stderr()[-2000:]
    assert stop_process(run.proc, timeout=40) == 0
    lines = [json.loads(line) for line in run.stderr().splitlines()]
    loggers = {line["logger"] for line in lines}
    assert "egressgate.gateway.service.workers" in loggers
    assert {"w0/egressgate.gateway.service.app", "w1/egressgate.gateway.service.app"} <= loggers, loggers
    assert all(set(line) >= {"ts", "level", "logger", "message"} for line in lines)
    text = tmp_path / "text"
    text.mkdir()
    runs.append(plain := Run(text, config(text), "--log-level", "DEBUG"))
    assert plain.info is not None
    stop_process(plain.proc)
    first = plain.stderr().splitlines()[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(first)


def test_a_reload_in_flight_at_stop_is_sealed_in_this_runs_file(tmp_path, runs):
    """SIGHUP and SIGTERM back to back (a supervisor fans out both in a moment): the stop waits for the reload
    the SIGHUP started, so its policy_reload record is in this run's sealed audit file and nothing is left in
    the retry spool for the next start. Without that wait the SIGHUP was lost (the stop ended the loop with
    the reload task cancelled: no reload, no record) or its record went to the spool (the sink closed first)."""
    runs.append(run := Run(tmp_path, config(tmp_path), "--workers", "1"))
    assert run.info is not None, run.stderr()
    before = len(audit_records(tmp_path / "var" / "audit.jsonl"))
    run.proc.send_signal(signal.SIGHUP)
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(60) == 0
    assert "policies reloaded (SIGHUP)" in run.stderr(), run.stderr()[-2000:]
    records = audit_records(tmp_path / "var" / "audit.jsonl")
    reloads = [r for r in records[before:] if r.get("egressgate.operation") == "policy_reload"]
    assert len(reloads) == 1 and reloads[0]["egressgate.decision"] == "allow", records[before:]
    assert not list((tmp_path / "var").glob("audit-retry*")), run.stderr()[-2000:]
    assert "retry spool" not in run.stderr()
