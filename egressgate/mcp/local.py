"""The stdio relay of `egressgate mcp run`: a local MCP server's stdin/stdout, through the gateway's decisions.

Shape: the MCP client (an agent) spawned `egressgate mcp run ... -- CMD`, so this process's stdin/stdout
are the client's pipe. CMD runs inside the sandbox runtime (netns + bubblewrap, the same network policy
as `sandbox run`) with its stdin/stdout piped to this process, which sits OUTSIDE the sandbox. Every
newline-delimited JSON-RPC line, in either direction, goes to the gateway's admin API
(`POST /v1/sandboxes/{id}/mcp/{server}/messages?direction=to_server|to_client`, the raw line as the body)
and only what the gateway answers is passed on: `forward` (the canonical re-serialization of what was
allowed, or null) to the other side, `replies` (JSON-RPC errors for denied calls) back to the sender.

Rules enforced here (each once):
* nothing reaches the other side that the gateway did not return as `forward`: the relay never parses,
  repairs or guesses a line, and any answer other than 200 (or a `forward` that is not exactly one line)
  ends the relay (fail closed);
* the relay never writes the audit trail: the gateway's McpSession decides, counts and records;
* a line longer than the policy's `mcp.max_message_bytes` is sent cut at max+1 bytes (the gateway refuses
  and records it) and the rest of it is discarded unread into memory: no unbounded buffering;
* the workload dies with the relay: the client's end of stdin (EOF) closes the server's stdin and kills
  it after GRACE_SECONDS, a client that stopped reading (EPIPE) kills it at once, and a revoked sandbox
  (polled every REVOCATION_POLL seconds, or answered 404/410 to a message) kills it at once.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from egressgate.runtimes.base import ExitInfo
from egressgate.runtimes.netns import NetnsAdapter
from egressgate.runtimes.run import Run, RunRequest
from egressgate.runtimes.workload import SetupFailed

GRACE_SECONDS = 1.0  # after the client's EOF: time for the server to exit on its own (the SDK's is 2 s)
REVOCATION_POLL = 0.5
EXIT_MCP_REFUSED = 126  # `mcp run` refused the local server (policy): the shell's "cannot execute"


def log(message: str) -> None:
    print(f"egressgate: {message}", file=sys.stderr, flush=True)


class AdminClient:
    """A keep-alive HTTP/1.1 connection to the admin API (one per relay thread; never through a proxy)."""

    def __init__(self, admin: tuple[str, int], token: str, timeout: float = 30.0) -> None:
        self.admin = admin
        self.token = token
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict[str, Any]]:
        """(status, JSON object); a connection the server closed between requests is reopened once.
        OSError when the admin API does not answer."""
        headers = {"Authorization": f"Bearer {self.token}"}
        if body is not None:
            headers["Content-Type"] = "application/octet-stream"
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(*self.admin, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=body, headers=headers)
                resp = self.conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {"error": raw[:200].decode("utf-8", "replace")}
        return resp.status, data if isinstance(data, dict) else {"error": str(data)[:200]}

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def read_line(stream: IO[bytes], limit: int) -> tuple[bytes, bool] | None:
    """One line without its newline, cut at `limit`+1 bytes (then the rest is read and dropped in bounded
    chunks): (line, cut). None at EOF with nothing read."""
    line = stream.readline(limit + 1)
    if not line:
        return None
    if line.endswith(b"\n"):
        return line[:-1].removesuffix(b"\r"), False
    if len(line) <= limit:  # EOF without a final newline: still one whole line
        return line, False
    while True:  # over the limit: skip to the end of this line
        rest = stream.readline(65536)
        if not rest or rest.endswith(b"\n"):
            return line, True


class Relay:
    """Pumps both directions through the gateway until either side ends (see the module docstring)."""

    def __init__(self, client_factory: Callable[[], AdminClient], sandbox_id: str, server: str,
                 max_line: int, proc: Any, kill: Callable[[], None],
                 client_in: IO[bytes] | None = None, client_out: IO[bytes] | None = None) -> None:
        self.new_client = client_factory
        self.base = f"/v1/sandboxes/{sandbox_id}/mcp/{server}"
        self.sandbox_id = sandbox_id
        self.max_line = max_line
        self.proc = proc  # Popen with stdin/stdout pipes (bwrap: the sandboxed server's stdio)
        self.kill = kill
        self.client_in = client_in if client_in is not None else sys.stdin.buffer
        self.client_out = client_out if client_out is not None else sys.stdout.buffer
        self.to_server_lock = threading.Lock()
        self.to_client_lock = threading.Lock()
        self.done = threading.Event()
        self.ended_by: str | None = None  # "client", "server", "revoked", "gateway"
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, target in (("mcp-to-server", self._pump_to_server), ("mcp-to-client", self._pump_to_client),
                             ("mcp-revocation", self._watch_revocation)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self.threads.append(thread)

    def _end(self, why: str, *, kill: bool) -> None:
        if self.ended_by is None:
            self.ended_by = why
        self.done.set()
        if kill:
            self.kill()

    # ------------------------------------------------------------------------------ writers
    def _write_server(self, data: bytes) -> None:
        with self.to_server_lock:
            try:
                self.proc.stdin.write(data + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):  # the server is gone: its stdout pump ends the relay
                pass

    def _write_client(self, data: bytes) -> None:
        with self.to_client_lock:
            try:
                self.client_out.write(data + b"\n")
                self.client_out.flush()
            except (BrokenPipeError, ValueError, OSError):
                self._end("client", kill=True)  # nobody reads the answers any more

    # ------------------------------------------------------------------------------ the gateway
    def _mediate(self, admin: AdminClient, direction: str, line: bytes) -> dict[str, Any] | None:
        """The gateway's answer for one line, or None when the relay must end (said on stderr)."""
        try:
            status, data = admin.request("POST", f"{self.base}/messages?direction={direction}", line)
        except (OSError, http.client.HTTPException) as exc:
            log(f"the gateway's admin API stopped answering ({exc}); the local MCP server was stopped")
            self._end("gateway", kill=True)
            return None
        forward = data.get("forward")
        one_line = forward is None or (isinstance(forward, str) and "\n" not in forward and "\r" not in forward)
        if status == 200 and one_line and isinstance(data.get("replies"), list):
            return data
        if status == 200:  # not one line and a list: never pass on what the other side could split otherwise
            log("the gateway answered a malformed relay message; the local MCP server was stopped")
            self._end("gateway", kill=True)
            return None
        if status in (404, 410):
            log(f"sandbox {self.sandbox_id} was revoked; the local MCP server was stopped")
            self._end("revoked", kill=True)
        else:
            log(f"the gateway refused the MCP session ({status}): {data.get('message') or data.get('error')}; "
                "the local MCP server was stopped")
            self._end("gateway", kill=True)
        return None

    def _pass_on(self, data: dict[str, Any], forward: Callable[[bytes], None], back: Callable[[bytes], None]) -> None:
        for reply in data["replies"]:
            back(json.dumps(reply, ensure_ascii=False, separators=(",", ":")).encode())
        if data["forward"] is not None:
            forward(data["forward"].encode())

    # ------------------------------------------------------------------------------ pumps
    def _pump_to_server(self) -> None:
        admin = self.new_client()
        try:
            while not self.done.is_set():
                got = read_line(self.client_in, self.max_line)
                if got is None:
                    break
                line, _cut = got
                if not line.strip():
                    continue  # an empty line carries no message
                data = self._mediate(admin, "to_server", line)
                if data is None:
                    return
                self._pass_on(data, self._write_server, self._write_client)
        except (OSError, ValueError):
            pass
        finally:
            admin.close()
        # the client closed its end: the server gets EOF too, and GRACE_SECONDS to exit on its own
        with self.to_server_lock, contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()
        if not self.done.wait(GRACE_SECONDS):
            self._end("client", kill=True)

    def _pump_to_client(self) -> None:
        admin = self.new_client()
        try:
            while not self.done.is_set():
                got = read_line(self.proc.stdout, self.max_line)
                if got is None:
                    break
                line, _cut = got
                if not line.strip():
                    continue
                data = self._mediate(admin, "to_client", line)
                if data is None:
                    return
                self._pass_on(data, self._write_client, self._write_server)
        except (OSError, ValueError):
            pass
        finally:
            admin.close()
        self._end("server", kill=False)  # the server closed its stdout (it exited): wait() sees why

    def _watch_revocation(self) -> None:
        admin = self.new_client()
        try:
            while not self.done.wait(REVOCATION_POLL):
                try:
                    status, data = admin.request("GET", f"/v1/sandboxes/{self.sandbox_id}")
                except (OSError, http.client.HTTPException):
                    continue  # a message will find out; a passing hiccup must not kill the server
                if status == 404 or (status == 200 and data.get("revoked") is True):
                    log(f"sandbox {self.sandbox_id} was revoked; the local MCP server was stopped")
                    self._end("revoked", kill=True)
        finally:
            admin.close()

    def finish(self, timeout: float = 5.0) -> None:
        """After the workload ended: let the pumps pass on what the server wrote last, then end the
        gateway's session (pending calls are recorded as unanswered there)."""
        for thread in self.threads:
            if thread.name == "mcp-to-client":
                thread.join(timeout)
        self.done.set()
        admin = self.new_client()
        try:
            admin.request("DELETE", self.base)
        except (OSError, http.client.HTTPException):
            pass  # revocation ends the gateway's session too
        finally:
            admin.close()
        for stream in (self.proc.stdout, self.proc.stdin):
            with contextlib.suppress(OSError, ValueError):
                stream.close()


class RelayedNetns(NetnsAdapter):
    """The netns runtime with the workload's stdin/stdout piped to a Relay (everything else unchanged:
    the same namespace, plumbing, bwrap isolation and limits as `sandbox run`)."""

    def __init__(self, make_relay: Callable[[str, Any, Callable[[], None]], Relay]) -> None:
        super().__init__()
        self.stdio = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        self.make_relay = make_relay
        self.relay: Relay | None = None

    def start(self) -> None:
        super().start()
        assert self.spec is not None and self.proc is not None
        self.relay = self.make_relay(self.spec.sandbox_id, self.proc, self.kill)
        self.relay.start()

    def wait(self, deadline: float | None) -> ExitInfo:
        try:
            return super().wait(deadline)
        finally:
            if self.relay is not None:
                self.relay.finish()


class McpRun(Run):
    """`sandbox run` whose workload is a local MCP server relayed through the gateway (runtimes/run.py
    does admission, plumbing, limits, teardown and revocation exactly as for any sandbox)."""

    def __init__(self, req: RunRequest, server: str, max_line: int) -> None:
        super().__init__(req)
        self.server = server
        self.max_line = max_line

    def make_adapter(self, runtime: str) -> RelayedNetns:
        if runtime != "netns":
            raise SetupFailed(f"egressgate mcp run supports --runtime netns only, not {runtime!r}")
        return RelayedNetns(self._relay)

    def _relay(self, sandbox_id: str, proc: Any, kill: Callable[[], None]) -> Relay:
        assert self.info is not None
        token = self.info.admin_token_file.read_text(encoding="utf-8").strip()
        admin = self.info.endpoints.admin
        return Relay(lambda: AdminClient(admin, token), sandbox_id, self.server, self.max_line, proc, kill)
