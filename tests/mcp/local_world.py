"""The local MCP tests' world: the real gateway in a closed network world (tests/runtimes/harness.py), the
real `egressgate mcp run` in its gw namespace, and tests/mcp/stdio_server.py (a real `mcp` SDK server)
inside the sandbox, run by the same Python as the tests (it needs the SDK).

That Python must be reachable by the sandbox uid 65534. Where its installation sits under a directory that
uid cannot traverse (here /root is 0700 and pyenv lives below it), `mcp run` is started in a private mount
namespace (slave propagation: nothing leaks to the host) in which the blocking directory is a 0755 tmpfs
holding only a bind of the installation: the same paths, nothing else of that directory visible, the host
unchanged. Where it is reachable already (a CI runner's toolcache), no wrapper is used.

A tree or venv under a directory the sandbox replaces with its own tmpfs (/tmp, /run, /var/tmp, /home: a
clone in /tmp) would be invisible inside it: the same wrapper then binds that directory at an alias under a
0755 tmpfs on /mnt, and the server is started by its alias paths (the venv's python by its unresolved alias
path, so the venv and its SDK are found).
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from egressgate.runtimes.workload import unreachable_parent
from tests.runtimes.harness import Gateway, runtime_policy, safety_net
from tests.support.launcher import EGRESSGATE

TREE = Path(__file__).resolve().parents[2]
SERVER_SCRIPT = TREE / "tests" / "mcp" / "stdio_server.py"
PYTHON = str(Path(sys.prefix) / "bin" / "python")  # the venv's python (it has the SDK), path not resolved
RECORD_IN_SANDBOX = "/workspace/calls.jsonl"


def mcp_policy(name: str, *, local: str = "allow") -> dict[str, Any]:
    """The runtime tests' base policy (api.allowed.test allowed, forbidden.test not) plus one local MCP
    server `tools` (echo with a constrained argument, fetch, lookup of the sandbox's own tenant only;
    delete_everything denied) and one remote
    server `remote-one` (not local: `mcp run --server remote-one` must be refused)."""
    body = runtime_policy(name, execution__local_mcp_servers=local)
    body["mcp"] = {"servers": [
        {"name": "tools", "local": True, "tools": {
            "allow": [{"name": "echo", "arguments": {"text": {"type": "string", "pattern": "^[a-z ]{1,40}$",
                                                               "required": True}}},
                      {"name": "fetch", "arguments": {"url": {"type": "string", "required": True}}},
                      {"name": "lookup", "arguments": {"project": {"equals_label": "tenant", "required": True}}}],
            "deny": ["delete_everything"]}},
        {"name": "remote-one", "url": "https://api.allowed.test/mcp", "tools": {"allow": [{"name": "echo"}]}},
    ]}
    # the netns sandbox's tree is an allowlist (runtimes/sandbox_fs.py): the test Python, its venv and the
    # server script's directory are allowed read-only, at the paths the sandbox sees them (aliases)
    aliases = _aliases()
    needed = dict.fromkeys(_seen_as(p, aliases) for p in (Path(sys.base_prefix), Path(sys.prefix),
                                                           SERVER_SCRIPT.parent))
    body["filesystem"]["allow"] = [{"path": p, "read": True} for p in needed]
    return body


# directories the netns sandbox mounts its own tmpfs over (egressgate/runtimes/netns.py)
SANDBOX_TMPFS = (Path("/tmp"), Path("/run"), Path("/var/tmp"), Path("/home"))
ALIAS_ROOT = Path("/mnt")


def _hidden_top(path: Path) -> Path | None:
    """The directory right under a sandbox-tmpfs root that holds `path` (None: the sandbox sees it)."""
    for root in SANDBOX_TMPFS:
        if path.is_relative_to(root) and path != root:
            return root / path.relative_to(root).parts[0]
    return None


def _aliases() -> dict[Path, Path]:
    """Host directory -> its alias under /mnt, for the venv and this tree when the sandbox would hide them."""
    tops = {top for p in (Path(sys.prefix), TREE) if (top := _hidden_top(p)) is not None}
    return {top: ALIAS_ROOT / f"e13l-{i}" for i, top in enumerate(sorted(tops))}


def _seen_as(path: Path, aliases: dict[Path, Path]) -> str:
    for top, alias in aliases.items():
        if path.is_relative_to(top):
            return str(alias / path.relative_to(top))
    return str(path)


def _mount_wrapper(aliases: dict[Path, Path]) -> list[str]:
    """[] when uid 65534 can reach the test Python, the venv and this tree, and the sandbox does not hide
    them; else the private-mount-namespace wrapper (module docstring): each blocking directory becomes a
    0755 tmpfs with only the needed entries bound back (e.g. /root/.pyenv and the CI clone under /root), and
    each hidden one is bound at its alias."""
    binds: dict[Path, set[Path]] = {}
    for path in (Path(sys.base_prefix) / "bin", Path(sys.prefix) / "bin", SERVER_SCRIPT):
        blocked = unreachable_parent(path)
        if blocked is not None:
            binds.setdefault(blocked, set()).add(blocked / path.relative_to(blocked).parts[0])
    if not binds and not aliases:
        return []
    pairs = [(blocked, child) for blocked, children in sorted(binds.items()) for child in sorted(children)]
    q = shlex.quote
    lines = ["set -e", "keep=$(mktemp -d /run/e13l-keep.XXXXXX)"]
    if aliases:
        lines.append(f"mount -t tmpfs -o mode=0755 e13l-alias {q(str(ALIAS_ROOT))}")
        lines += [f"mkdir {q(str(alias))}; mount --bind {q(str(top))} {q(str(alias))}"
                  for top, alias in aliases.items()]
    lines += [f"mkdir \"$keep/{i}\"; mount --bind {q(str(child))} \"$keep/{i}\"" for i, (_, child) in enumerate(pairs)]
    lines += [f"mount -t tmpfs -o mode=0755 e13l {q(str(blocked))}" for blocked in sorted(binds)]
    lines += [f"mkdir -p {q(str(child))}; mount --bind \"$keep/{i}\" {q(str(child))}; umount -l \"$keep/{i}\"; "
              f"rmdir \"$keep/{i}\"" for i, (_, child) in enumerate(pairs)]
    lines += ["rmdir \"$keep\"", "exec \"$@\""]
    return ["unshare", "--mount", "--propagation", "slave", "sh", "-c", "; ".join(lines), "sh"]


def mcp_argv(gw: Gateway, policy: str, *, server: str = "tools", workspace: Path | None = None,
             tag: str = "", labels: tuple[str, ...] = (), linger: bool = False) -> list[str]:
    """`egressgate mcp run ... -- python stdio_server.py --record /workspace/calls.jsonl --tag TAG` in gw."""
    extra = ["--workspace", str(workspace)] if workspace else []
    for label in labels:
        extra += ["--label", label]
    aliases = _aliases()
    return ["nsenter", f"--net=/run/netns/{gw.world.gw}", *_mount_wrapper(aliases), EGRESSGATE, "mcp", "run",
            "--config", str(gw.config), "--policy", policy, "--server", server, *extra, "--",
            _seen_as(Path(PYTHON), aliases), _seen_as(SERVER_SCRIPT, aliases), "--record", RECORD_IN_SANDBOX,
            "--tag", tag, *(["--linger"] if linger else [])]


def child_env() -> dict[str, str]:
    """What the console script needs to import this tree (the SDK client passes only a safe subset)."""
    return {"PYTHONPATH": str(TREE), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def calls(workspace: Path) -> list[dict[str, Any]]:
    path = workspace / "calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tagged_pids(tag: str) -> list[int]:
    """Processes whose command line carries `tag` (the server inside the sandbox, seen from the host)."""
    out = []
    needle = tag.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if needle in fh.read():
                    out.append(int(entry))
        except OSError:
            continue
    return out


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class RawSession:
    """A hand-written MCP client over `mcp run`'s stdio: it can send what no SDK client would (duplicate
    keys, hidden batch members). Lines are read on a thread so every read has a deadline."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, **child_env()}, preexec_fn=safety_net)
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.stderr = b""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for chunk in self.proc.stderr:
            self.stderr += chunk

    def send(self, message: dict | bytes) -> None:
        data = message if isinstance(message, bytes) else json.dumps(message).encode()
        assert self.proc.stdin is not None
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 20.0) -> Any:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"no answer within {timeout} s; stderr: {self.stderr.decode()[-2000:]}") from None

    def initialize(self) -> dict:
        self.send({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                   "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                              "clientInfo": {"name": "raw-test-client", "version": "0"}}})
        answer = self.recv(timeout=30)
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return answer

    def call(self, id_: int, tool: str, arguments: dict) -> dict:
        self.send({"jsonrpc": "2.0", "id": id_, "method": "tools/call",
                   "params": {"name": tool, "arguments": arguments}})
        return self.recv()

    def close(self, timeout: float = 15) -> int:
        """Close stdin (the client goes away) and wait for `mcp run` to end; kills it past the timeout."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def direct_server(record: Path, tag: str) -> subprocess.Popen[bytes]:
    """The same SDK server WITHOUT egressgate (positive controls: what the server would do with a line)."""
    return subprocess.Popen([PYTHON, str(SERVER_SCRIPT), "--record", str(record), "--tag", tag],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


