"""Starting and stopping the real gateway (`egressgate run --config CFG`), as an operator would.

Every harness that runs a gateway (the loopback worlds in tests/support/gwworld.py and credworld.py, the
network-namespace world in tests/support/netgateway.py) goes through here, so the startup contract is
read in one place: `egressgate run` prints ONE JSON line on stdout naming its listeners (`proxy`,
`admin`, `dns`, `transparent`) once it serves, or exits; its log goes to stderr (kept in a file so a
failing test can show it).
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import httpx
import yaml

from tests.support import zygote

if TYPE_CHECKING:
    from tests.networld import World

EGRESSGATE = str(Path(sys.executable).with_name("egressgate"))

# runtime.uid_range of every gateway a test starts: each run of `sandbox run` takes a host uid from its
# gateway's range (egressgate/runtimes/identity.py), and allocation is per state dir, so gateways that run
# at the same time (xdist workers, other checkouts' test runs) must not share uids. Each test process holds
# one block (an flock, released when the process dies) and hands each gateway it starts its own slice.
UID_BLOCKS_DIR = Path("/tmp/egressgate-test-uid-blocks")
UID_BLOCK_BASE, UID_BLOCK, UID_SLICE = 1_000_000, 4096, 256
_uid_block: list[int] = []  # [first uid of this process's block, lock fd, next slice]


def private_uid_range(size: int = UID_SLICE) -> str:
    """A "FIRST-LAST" range of `size` (≤ 256) uids no other gateway started by a test is given now."""
    if not _uid_block:
        import fcntl

        UID_BLOCKS_DIR.mkdir(mode=0o700, exist_ok=True)
        for k in range(4096):
            fd = os.open(UID_BLOCKS_DIR / f"{k}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _uid_block.extend([UID_BLOCK_BASE + k * UID_BLOCK, fd, 0])
            break
        else:
            raise RuntimeError(f"no free test uid block in {UID_BLOCKS_DIR}")
    first = _uid_block[0] + (_uid_block[2] % (UID_BLOCK // UID_SLICE)) * UID_SLICE
    _uid_block[2] += 1
    return f"{first}-{first + min(size, UID_SLICE) - 1}"


def with_uid_range(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with a test-private runtime.uid_range unless it sets one."""
    runtime = dict(config.get("runtime") or {})
    runtime.setdefault("uid_range", private_uid_range())
    return {**config, "runtime": runtime}


def write_policies(policy_dir: Path, docs: dict[str, dict]) -> Path:
    """One `<name>.yaml` per policy document (key order kept: the files are read by people too)."""
    policy_dir.mkdir(parents=True, exist_ok=True)
    for name, doc in docs.items():
        (policy_dir / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return policy_dir


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first stdout line, or "" after `timeout` (a reader thread: readline itself cannot time out)."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else ""


# A hang guard, not a speed assertion: a gateway starts in ~1 s, but on a 2-core machine running the suite's
# workers (and a CPU hog, the determinism check) its imports alone took over 30 s. Slow is not broken.
STARTUP_TIMEOUT = 120.0


# Gateways this process has waited for (`--cpu-report`, tests/support/cpu_usage.py: starts per module).
GATEWAY_STARTS = 0


def startup_info(proc: subprocess.Popen, stderr_path: Path, timeout: float = STARTUP_TIMEOUT) -> dict[str, Any]:
    """The startup line as a dict; a gateway that does not print one is killed and its log shown."""
    global GATEWAY_STARTS
    GATEWAY_STARTS += 1
    line = first_line(proc, timeout)
    try:
        info = json.loads(line)
        if not isinstance(info, dict) or "proxy" not in info:
            raise ValueError(line)
    except ValueError as exc:
        proc.kill()
        proc.wait(5)
        raise RuntimeError(f"gateway did not start: stdout={line!r}\n{stderr_path.read_text()[-3000:]}") from exc
    return info


def host_port(listener: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` from the startup line -> (host, port)."""
    host, _, port = listener.rpartition(":")
    return host.strip("[]"), int(port)


def drain(proc: subprocess.Popen) -> None:
    """Read stdout to the end in a daemon thread, so a chatty gateway never blocks on a full pipe."""
    def run() -> None:
        if proc.stdout is not None:
            for _ in proc.stdout:
                pass
    threading.Thread(target=run, daemon=True).start()


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> int:
    """SIGTERM (the gateway's graceful stop), then SIGKILL after `timeout`: its exit code, -9 if killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            return -9
    return proc.returncode


def flatten_otlp(record: dict[str, Any]) -> dict[str, Any]:
    """The attributes of an OTLP-JSON audit line as one flat {key: value} dict."""
    out: dict[str, Any] = {}
    for rl in record.get("resourceLogs", []):
        for sl in rl.get("scopeLogs", []):
            for lr in sl.get("logRecords", []):
                for attr in lr.get("attributes", []):
                    value = attr["value"]
                    out[attr["key"]] = next(iter(value.values())) if value else None
    return out


def labels_of(record: dict[str, Any]) -> dict[str, str] | None:
    """A flattened record's `egressgate.sandbox.labels` (an OTLP kvlist) as a dict; None when absent."""
    raw = record.get("egressgate.sandbox.labels")
    if raw is None:
        return None
    return {kv["key"]: next(iter(kv["value"].values())) for kv in raw.get("values", [])}


def complete_lines(path: Path) -> list[str]:
    """The non-empty lines of a file another process may be appending to: a last line without its newline
    is not written yet (parsing it raced the gateway's audit writer under load)."""
    text = path.read_text()
    return [line for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def audit_records(path: Path) -> list[dict[str, Any]]:
    """Every complete record of an audit trail file (one OTLP-JSON record per line), flattened, in order."""
    return [flatten_otlp(json.loads(line)) for line in complete_lines(path)]


@dataclass
class LoopbackGateway:
    """A gateway process on loopback (no namespaces): its listeners, admin token and files."""

    proc: subprocess.Popen
    config: Path
    var: Path
    proxy: tuple[str, int]
    admin: str
    token: str
    stderr_path: Path

    @property
    def bundle(self) -> str:
        """The CA bundle a sandbox trusts (the gateway's interception CA)."""
        return str(self.var / "ca" / "sandbox-ca-bundle.pem")

    def audit_text(self) -> str:
        return (self.var / "audit.jsonl").read_text()

    def audit_records(self) -> list[dict]:
        return audit_records(self.var / "audit.jsonl")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def admit_sandbox(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/sandboxes on the admin API (asserts 201): the new sandbox's id, token, proxy_url, env."""
        res = httpx.post(f"http://{self.admin}/v1/sandboxes", json=body,
                         headers={"Authorization": f"Bearer {self.token}"}, timeout=10, trust_env=False)
        assert res.status_code == 201, res.text
        return res.json()

    def revoke(self, sandbox_id: str) -> httpx.Response:
        return httpx.delete(f"http://{self.admin}/v1/sandboxes/{sandbox_id}",
                            headers={"Authorization": f"Bearer {self.token}"}, timeout=10, trust_env=False)

    def proxied_client(self, proxy_url: str, **kw: Any) -> httpx.Client:
        """An httpx client through the proxy (`proxy_url` carries the sandbox's credentials), trusting the
        gateway's interception CA only; no environment proxies."""
        kw.setdefault("timeout", 15)
        return httpx.Client(proxy=proxy_url, verify=ssl.create_default_context(cafile=self.bundle),
                            trust_env=False, **kw)


def stop_gateway(gw: LoopbackGateway) -> int:
    """Stop a loopback gateway (SIGTERM, then SIGKILL after 15 s); its exit code."""
    return stop_process(gw.proc)


def start_all[G](starts: list[Callable[[], G]], stop: Callable[[G], object]) -> list[G]:
    """Run every `start` at once (threads: a gateway's start-up is a CPU-bound Python import on another
    core, plus a wait for its startup line) and return their results in order. All or nothing: if any
    start fails, the ones that started are stopped with `stop` and the first failure is raised."""
    with ThreadPoolExecutor(max(1, len(starts))) as pool:
        futures = [pool.submit(start) for start in starts]
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures:
        for f in futures:
            if f.exception() is None:
                stop(f.result())
        raise failures[0]
    return [f.result() for f in futures]


def launch_loopback(tmp: Path, config: dict[str, Any], *, launcher: list[str] | None = None,
                    private: bool = False, args: Sequence[str] = ()) -> dict[str, Any]:
    """Write `config` to tmp/gateway.yaml (0600 with `private`: it holds broker secrets), run the
    gateway (`launcher` replaces the `egressgate` command, e.g. a script that plants a fault first; `args`
    are appended to `run`'s, e.g. `--workers 2`) and wait for its startup line. Returns the
    LoopbackGateway fields, for the caller's own dataclass."""
    cfg = tmp / "gateway.yaml"
    cfg.write_text(yaml.safe_dump(with_uid_range(config)))
    if private:
        os.chmod(cfg, 0o600)
    stderr_path = tmp / "gateway.stderr"
    stderr = open(stderr_path, "w")  # noqa: SIM115 - lives with the process
    argv = [*(launcher or [EGRESSGATE]), "run", "--config", str(cfg), "--log-level", "DEBUG", *args]
    env = {**os.environ, "NO_PROXY": ""}
    # a custom launcher is a real command of its own; the console script forks from the zygote (zygote.py)
    start = subprocess.Popen if launcher else zygote.popen
    proc = start(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    info = startup_info(proc, stderr_path)
    var = Path(config["var_dir"])
    return {"proc": proc, "config": cfg, "var": var, "proxy": host_port(info["proxy"]), "admin": info["admin"],
            "token": (var / "admin.token").read_text().strip(), "stderr_path": stderr_path}




def launch_in_namespace(world: World, ns: str, tmp: Path, config: dict[str, Any],
                        launcher: list[str] | None = None) -> tuple[subprocess.Popen, dict[str, Any], Path, IO[str]]:
    """Write `config` to tmp/gateway.yaml and run the gateway inside the world's namespace `ns` (as an
    operator would, at the default log level); returns the process, its startup line, the config path
    and its open stderr file (close it after stopping the process). Stdout is drained after the line."""
    cfg = tmp / "gateway.yaml"
    cfg.write_text(yaml.safe_dump(with_uid_range(config)))
    stderr = open(tmp / "gateway.stderr", "w")  # noqa: SIM115 - lives as long as the process
    if launcher:
        proc = world.popen(ns, *launcher, "run", "--config", str(cfg), stdout=subprocess.PIPE, stderr=stderr)
    else:  # `ip netns exec ns egressgate run ...`, forked from the zygote (zygote.py)
        proc = zygote.popen([EGRESSGATE, "run", "--config", str(cfg)], netns=ns, stdout=subprocess.PIPE, stderr=stderr,
                            text=True)
    info = startup_info(proc, tmp / "gateway.stderr")
    drain(proc)
    return proc, info, cfg, stderr
