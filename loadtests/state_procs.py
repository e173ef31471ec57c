"""Processes `make bench-state` starts in its namespace world: Redis, and gateways per state backend/workers.

Everything runs in the world's gateway namespace (loopback there is private to the namespace, so fixed
ports cannot clash with another helper's Redis or gateway, and Redis is "loopback Redis" as a deployment
co-located with the gateway would have it). Redis runs with appendonly on (fsync everysec, Redis's default
durability for an append-only file): the configuration a gateway that must not forget spent budgets needs.

Gateway CPU is read from /proc for the whole process tree (the supervisor and every worker, plus what
exited workers used: cutime/cstime of their waited-for parent), because `--workers N` forks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtests import bench_procs, procs
from loadtests.bench_world import ADDR, World

HZ = os.sysconf("SC_CLK_TCK")
REDIS_PORT = 16380  # inside the world's gateway namespace only (never 6379; never a Redis we did not start)


@dataclass(frozen=True)
class Candidate:
    """One gateway under test: which state backend, how many worker processes, its fixed ports."""

    name: str
    backend: str  # memory | redis
    workers: int
    proxy_port: int
    admin_port: int
    own_session: bool = False  # started under setsid: its own session, so its own scheduler autogroup
    base: bool = False  # runs the code of another tree (BASE_SRC_ENV, `--base-src`): an A/B in one run


CANDIDATES = {
    "memory": Candidate("memory", "memory", 1, 8101, 9101),
    "redis": Candidate("redis", "redis", 1, 8102, 9102),
    "redis-2w": Candidate("redis-2w", "redis", 2, 8103, 9103),
    # diagnostic: one process like `redis`, but in its own session as every --workers worker is (workers.py
    # starts them with start_new_session); with kernel.sched_autogroup_enabled=1 a session is a scheduling
    # group of its own, which changes how it shares a busy CPU with the client, upstream and Redis
    "redis-setsid": Candidate("redis-setsid", "redis", 1, 8104, 9104, own_session=True),
    # only if named, with `--base-src DIR` (e.g. `git archive main | tar -x -C DIR`): the same candidates
    # running that tree's egressgate (PYTHONPATH=DIR ahead of this checkout's editable install), measured
    # interleaved with this tree's, so a before/after comparison shares the machine's load
    "memory-base": Candidate("memory-base", "memory", 1, 8105, 9105, base=True),
    "redis-base": Candidate("redis-base", "redis", 1, 8106, 9106, base=True),
}
BASE_SRC_ENV = "EGB_STATE_BASE_SRC"


def redis_cmd(prefix: Sequence[str], port: int, *args: str, timeout: float = 10) -> str:
    """redis-cli against our own Redis (in the world's namespace when `prefix` says so)."""
    out = subprocess.run([*prefix, "redis-cli", "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"redis-cli {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def start_redis(directory: Path, port: int, prefix: Sequence[str] = ()) -> procs.Proc:
    """redis-server on 127.0.0.1:`port` (of the namespace `prefix` runs it in), data in its own dir."""
    d = directory / "redis"
    d.mkdir(parents=True, exist_ok=True)
    log = d / "redis.log"
    cmd = [*prefix, shutil.which("redis-server") or "/usr/bin/redis-server", "--bind", "127.0.0.1",
           "--port", str(port), "--dir", str(d), "--appendonly", "yes", "--appendfsync", "everysec",
           "--save", "", "--protected-mode", "yes", "--daemonize", "no", "--logfile", str(log)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    p = procs.Proc("redis", proc, logs=[log], info={"cmd": " ".join(cmd), "port": port,
                                                    "url": f"redis://127.0.0.1:{port}/0"})
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}:\n{p.log_tail()}")
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            if redis_cmd(prefix, port, "ping", timeout=2).strip() == "PONG":
                break
        if time.monotonic() > deadline:
            p.stop()
            raise RuntimeError("redis-server did not answer PING within 20 s:\n" + p.log_tail())
        time.sleep(0.05)
    p.info["version"] = redis_cmd(prefix, port, "info", "server").split("redis_version:", 1)[1].split()[0]
    return p


def start_gateway(world: World, directory: Path, upstream_ca: Path, http_port: int, https_port: int,
                  cand: Candidate, redis_url: str | None, run_tag: str, profile_dir: Path | None = None,
                  in_place: bool = False) -> procs.Proc:
    """`egressgate run [--workers N]` with `state:` for the candidate's backend, and one sandbox admitted
    with the real `egressgate sandbox admit` (through the admin API, so with Redis every worker sees it).
    Each Redis candidate has its own key prefix: they share the Redis server, never a sandbox or a budget.
    `profile_dir`: another gateway of this candidate, every process of it (workers too) under cProfile
    (loadtests/profile_env/sitecustomize.py: off until SIGUSR1, stats to profile_dir/PID.prof at exit), on
    ports 100 above the candidate's, with its own sandbox and key prefix; with `in_place`, the candidate's own
    gateway with the profiling hook installed (off until SIGUSR1: its measured cells are not profiled)."""
    if profile_dir is not None and not in_place:
        cand = Candidate(cand.name + "-profiled", cand.backend, cand.workers, cand.proxy_port + 100,
                         cand.admin_port + 100, cand.own_session, cand.base)
    d = directory / cand.name
    pol = d / "policies"
    pol.mkdir(parents=True, exist_ok=True)
    import yaml

    (pol / "bench.yaml").write_text(yaml.safe_dump(bench_procs.world_policy(http_port, https_port)))
    listen = {"proxy": f"{ADDR['gw']}:{cand.proxy_port}", "admin": f"127.0.0.1:{cand.admin_port}", "dns": None,
              "transparent": None}
    extra: dict = {}
    if cand.backend == "redis":
        if redis_url is None:
            raise RuntimeError("no Redis")
        extra["state"] = {"backend": "redis", "url": redis_url, "key_prefix": f"egB-{run_tag}-{cand.name}:"}
    program = [procs.EGRESSGATE, "run"] + (["--workers", str(cand.workers)] if cand.workers > 1 else [])
    if cand.own_session:
        program = ["setsid", *program]  # not a group leader (Popen's child): setsid() then exec, same pid
    env = _profiling_env(profile_dir)
    if cand.base:
        base = os.environ.get(BASE_SRC_ENV)
        if not base or not (Path(base) / "egressgate" / "__init__.py").exists():
            raise RuntimeError(f"{cand.name} needs --base-src DIR (a tree with egressgate/), got {base!r}")
        env = dict(env or os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (base, env.get("PYTHONPATH")) if x)
    p = procs.launch_egressgate(d, upstream_ca, listen, {"sandbox": "bench"}, name=cand.name, extra_config=extra,
                                program=program, prefix=world.exec_prefix("gw"), env=env)
    p.info["key_prefix"] = extra.get("state", {}).get("key_prefix")
    pids = tree_pids(p.pid)
    p.info["pids_at_start"] = pids
    if len(pids) < cand.workers:
        p.stop()
        raise RuntimeError(f"--workers {cand.workers}: only {len(pids)} process(es) in the gateway's tree")
    return p


def _profiling_env(profile_dir: Path | None) -> dict[str, str] | None:
    """The environment the gateway (and the workers it starts, which inherit it) is launched with: a copy,
    never this process's own (several gateways start at once from threads; the CLI calls stay unprofiled)."""
    if profile_dir is None:
        return None
    profile_dir.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["EGB_CPROFILE_DIR"] = str(profile_dir)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(here / "profile_env"), str(here.parent),
                                                     os.environ.get("PYTHONPATH")) if x)
    return env


def tree_pids(pid: int) -> list[int]:
    """`pid` and every live descendant (from /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    todo.extend(int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split())
    return out


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree_cpu_by_pid(pid: int) -> dict[int, float]:
    """Own CPU seconds (utime+stime) of each live process of the tree: how the load spread over workers."""
    out = {}
    for p in tree_pids(pid):
        f = _stat_fields(p)
        if f is not None:
            out[p] = (int(f[11]) + int(f[12])) / HZ
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of the gateway's whole tree: utime+stime of every live process, plus cutime+cstime (what
    children that already exited and were waited for used; a restarted worker's CPU is not lost)."""
    total = 0
    for p in tree_pids(pid):
        f = _stat_fields(p)
        if f is not None:
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / HZ


def redis_stats(prefix: Sequence[str], port: int) -> dict:
    """Commands by name (calls, usec) and per-command latency percentiles (Redis >= 7 latency tracking)."""
    cmds: dict[str, dict] = {}
    for line in redis_cmd(prefix, port, "info", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[8:].split(":", 1)
            kv = dict(x.split("=", 1) for x in rest.strip().split(","))
            cmds[name] = {"calls": int(kv["calls"]), "usec": int(kv["usec"])}
    lat: dict[str, dict] = {}
    with contextlib.suppress(RuntimeError):
        for line in redis_cmd(prefix, port, "info", "latencystats").splitlines():
            if line.startswith("latency_percentiles_usec_"):
                name, rest = line[len("latency_percentiles_usec_"):].split(":", 1)
                lat[name] = {k: float(v) for k, v in (x.split("=", 1) for x in rest.strip().split(","))}
    return {"commands": cmds, "latency_usec": lat}


def redis_reads(prefix: Sequence[str], port: int) -> int:
    """INFO stats total_reads_processed: socket reads Redis served, ~ one per client round trip."""
    info = redis_cmd(prefix, port, "info", "stats")
    return int(info.split("total_reads_processed:", 1)[1].split()[0])


def redis_reset(prefix: Sequence[str], port: int) -> None:
    redis_cmd(prefix, port, "config", "resetstat")


def redis_cpu(prefix: Sequence[str], port: int) -> float:
    info = redis_cmd(prefix, port, "info", "cpu")
    vals = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    return float(vals["used_cpu_sys"]) + float(vals["used_cpu_user"])
