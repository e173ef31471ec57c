"""A minimal Docker Engine API client over the daemon's unix socket (stdlib only).

Why not the docker CLI: each fork of the Go CLI costs 25-40 ms of start-up before it sends one request,
and a `sandbox run` needs six or more (create+start, inspect, logs, wait, inspect, rm): most of the
docker runtime's start-up overhead (loadtests/RESULTS.md). The same requests over the socket cost about
a millisecond each, with a small HTTP/1.1 reader of its own (see _Response: http.client would add
~20 ms of imports).

Why unix sockets only: a `tcp://` daemon socket without TLS is root on the host for anyone who can reach
it, and egressgate would have to carry the CLI's TLS settings to talk to one safely; `ssh://` needs the
CLI. Both are refused with a message saying so (the daemon must also be local for the adapter's
namespace and cgroup checks).

Every failure is a DockerError naming the call and carrying the daemon's own message, so `sandbox run`
fails closed with exit 120 and one readable line, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote, urlencode

DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
MIN_API = (1, 25)  # HostConfig.Init, Mounts: what containers/create needs
TIMEOUT = 60.0
MAX_LINE = 65536  # one status/header/chunk-size line
MAX_HEADERS = 100


class DockerError(RuntimeError):
    """The daemon refused or could not be reached; the message names the call and the daemon's reason."""


class NotFound(DockerError):
    """The daemon answered 404 (no such container or image)."""


def socket_path(host: str) -> str:
    """The unix socket path of a DOCKER_HOST value; any other scheme is refused (module docstring)."""
    if host.startswith("unix://"):
        path = host[len("unix://"):]
        if path.startswith("/"):
            return path
    raise DockerError(f"docker host {host!r} is not supported: egressgate talks to a local Docker daemon over "
                      f"its unix socket only (set runtime.docker_host or DOCKER_HOST to unix:///path/to/docker.sock)")


class HTTPError(OSError):
    """The daemon's answer is not well-formed HTTP/1.1."""


class _Response:
    """One HTTP/1.1 response read from a unix socket (the request said `Connection: close`). A hand-made
    reader, not http.client: that module pulls in the email package (~20 ms of `sandbox run` start-up,
    which no longer imports urllib). Bodies are Content-Length, chunked (wait, logs) or until EOF."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._file = sock.makefile("rb")
        line = self._line()
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HTTPError(f"not an HTTP response: {line[:80]!r}")
        self.status = int(parts[1])
        self.headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS):
            line = self._line()
            if not line:
                break
            key, _, value = line.decode("latin-1").partition(":")
            self.headers[key.strip().lower()] = value.strip()
        else:
            raise HTTPError("too many response headers")
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length", "")
        self._left: int | None = int(length) if length.isdigit() and not self._chunked else None
        self._chunk_left = 0
        self._eof = self.status in (204, 304) or self._left == 0

    def _line(self) -> bytes:
        line = self._file.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            raise HTTPError("response line too long")
        if not line.endswith(b"\n"):
            raise HTTPError("connection closed in the response head")
        return line.rstrip(b"\r\n")

    def getheader(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def read(self, n: int = -1) -> bytes:
        """Up to n body bytes (all when n < 0); fewer only at the end of the body."""
        out = bytearray()
        while not self._eof and (n < 0 or len(out) < n):
            want = (1 << 16) if n < 0 else n - len(out)
            if self._chunked:
                if self._chunk_left == 0:
                    size = self._line().split(b";", 1)[0].strip()
                    try:
                        self._chunk_left = int(size, 16)
                    except ValueError:
                        raise HTTPError(f"bad chunk size {size[:20]!r}") from None
                    if self._chunk_left == 0:
                        while self._line():  # trailers
                            pass
                        self._eof = True
                        break
                data = self._file.read(min(want, self._chunk_left))
                if not data:
                    raise HTTPError("connection closed inside a chunk")
                self._chunk_left -= len(data)
                if self._chunk_left == 0:
                    self._line()  # the CRLF after the chunk
            elif self._left is not None:
                data = self._file.read(min(want, self._left))
                if not data:
                    raise HTTPError("connection closed before the end of the body")
                self._left -= len(data)
                self._eof = self._left == 0
            else:
                data = self._file.read1(want) if n < 0 else self._file.read(want)
                if not data:
                    self._eof = True
            out += data
        return bytes(out)

    def close(self) -> None:
        self._file.close()
        self.sock.close()


class DockerAPI:
    """One daemon. Each request opens its own connection (a unix connect costs microseconds), so
    blocking calls (wait, logs) can run in threads beside the others."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.path = socket_path(host)
        self._prefix: str | None = None

    # ------------------------------------------------------------------------------ transport
    def _open(self, method: str, url: str, body: object | None, timeout: float | None, call: str) -> _Response:
        data = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {url} HTTP/1.1\r\nHost: docker\r\nConnection: close\r\nContent-Length: {len(data)}\r\n"
        if body is not None:
            head += "Content-Type: application/json\r\n"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(self.path)
            sock.sendall(head.encode("latin-1") + b"\r\n" + data)
            return _Response(sock)
        except TimeoutError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise DockerError(f"docker API {call}: cannot reach the daemon at {self.host}: {exc}") from None

    def _url(self, path: str, query: dict[str, object] | None) -> str:
        if self._prefix is None:
            self._prefix = f"/v{self._negotiate()}"
        qs = f"?{urlencode(query)}" if query else ""
        return f"{self._prefix}{path}{qs}"

    def _negotiate(self) -> str:
        """The daemon's own API version (GET /_ping's API-Version header, as the CLI negotiates it): every
        field sent here exists since 1.25, and a daemon's minimum may be above any version pinned today."""
        resp = self._open("GET", "/_ping", None, TIMEOUT, "ping")
        try:
            resp.read()
            version = resp.getheader("API-Version") or ""
        except OSError as exc:
            raise DockerError(f"docker API ping: the connection to {self.host} broke: {exc}") from None
        finally:
            resp.close()
        try:
            parsed = tuple(int(p) for p in version.split("."))
        except ValueError:
            parsed = ()
        if resp.status != 200 or len(parsed) != 2:
            raise DockerError(f"docker API ping: {self.host} did not answer as a Docker daemon "
                              f"(HTTP {resp.status}, API-Version {version!r})")
        if parsed < MIN_API:
            raise DockerError(f"docker API ping: the daemon at {self.host} speaks API {version}; egressgate "
                              f"needs {MIN_API[0]}.{MIN_API[1]} or newer")
        return version

    def call(self, method: str, path: str, call: str, *, query: dict[str, object] | None = None,
             body: object | None = None, timeout: float | None = TIMEOUT, ok: tuple[int, ...] = (),
             timeout_raises: bool = False) -> object:
        """One request; the decoded JSON answer (None when empty). Statuses >= 400 not in `ok` raise. No
        answer within `timeout`: a DockerError naming the call, or TimeoutError with `timeout_raises`
        (for a deadline the caller acts on)."""
        try:
            resp = self._open(method, self._url(path, query), body, timeout, call)
            try:
                raw = resp.read()
            finally:
                resp.close()
        except TimeoutError:
            if timeout_raises:
                raise
            raise DockerError(f"docker API {call}: no answer from {self.host} within {timeout} s") from None
        except OSError as exc:
            raise DockerError(f"docker API {call}: the connection to {self.host} broke: {exc}") from None
        if resp.status >= 400 and resp.status not in ok:
            message = _message(raw)
            kind = NotFound if resp.status == 404 else DockerError
            raise kind(f"docker API {call} failed (HTTP {resp.status}): {message}")
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    # ------------------------------------------------------------------------------ calls
    def create(self, name: str, config: dict) -> str:
        out = self.call("POST", "/containers/create", f"create {name}", query={"name": name}, body=config)
        return str(out["Id"]) if isinstance(out, dict) else name

    def start(self, ref: str) -> None:
        self.call("POST", f"/containers/{quote(ref)}/start", f"start {ref}", ok=(304,))

    def inspect(self, ref: str) -> dict:
        out = self.call("GET", f"/containers/{quote(ref)}/json", f"inspect {ref}")
        return out if isinstance(out, dict) else {}

    def image_id(self, image: str) -> str:
        out = self.call("GET", f"/images/{quote(image, safe='')}/json", f"image inspect {image}")
        return str(out.get("Id", "")) if isinstance(out, dict) else ""

    def wait(self, ref: str, timeout: float | None) -> int:
        """The exit status once the container is not running; TimeoutError after `timeout` seconds."""
        out = self.call("POST", f"/containers/{quote(ref)}/wait", f"wait {ref}", query={"condition": "not-running"},
                        timeout=timeout, timeout_raises=True)
        if not isinstance(out, dict) or "StatusCode" not in out:
            raise DockerError(f"docker API wait {ref}: unexpected answer {out!r}")
        error = (out.get("Error") or {}).get("Message") if isinstance(out.get("Error"), dict) else None
        if error:
            raise DockerError(f"docker API wait {ref}: {error}")
        return int(out["StatusCode"])

    def kill(self, ref: str) -> None:
        """SIGKILL; a container that is not running (409) or gone (404) is not an error here."""
        self.call("POST", f"/containers/{quote(ref)}/kill", f"kill {ref}", ok=(404, 409))

    def remove(self, ref: str) -> bool:
        """Force-remove with its anonymous volumes; False when there was no such container."""
        try:
            self.call("DELETE", f"/containers/{quote(ref)}", f"remove {ref}", query={"force": "1", "v": "1"})
        except NotFound:
            return False
        return True

    def containers(self, label: str) -> list[dict]:
        """Every container (running or not) that carries `label`."""
        out = self.call("GET", "/containers/json", f"list label={label}",
                        query={"all": "1", "filters": json.dumps({"label": [label]})})
        return out if isinstance(out, list) else []

    def logs(self, ref: str, *, follow: bool, timeout: float | None = None) -> Iterator[tuple[int, bytes]]:
        """(stream, bytes) frames of a non-TTY container's output (1 = stdout, 2 = stderr), from its start;
        with `follow`, until it stops. The stream is multiplexed: an 8-byte header (stream, 0, 0, 0,
        big-endian length) before each frame."""
        url = self._url(f"/containers/{quote(ref)}/logs",
                        {"stdout": "1", "stderr": "1", "follow": "1" if follow else "0"})
        resp = self._open("GET", url, None, timeout, f"logs {ref}")
        try:
            if resp.status >= 400:
                raise DockerError(f"docker API logs {ref} failed (HTTP {resp.status}): {_message(resp.read())}")
            yield from _frames(resp.read)
        finally:
            resp.close()

    def log_stream(self, ref: str) -> tuple[Callable[[], None], Iterator[tuple[int, bytes]]]:
        """Follow the logs in a thread that can be stopped: (close, frames). close() shuts the socket
        down, which ends the iteration in the other thread."""
        url = self._url(f"/containers/{quote(ref)}/logs", {"stdout": "1", "stderr": "1", "follow": "1"})
        resp = self._open("GET", url, None, None, f"logs {ref}")
        if resp.status >= 400:
            message = _message(resp.read())
            resp.close()
            raise DockerError(f"docker API logs {ref} failed (HTTP {resp.status}): {message}")

        def close() -> None:
            with contextlib.suppress(OSError):
                resp.sock.shutdown(socket.SHUT_RDWR)

        def frames() -> Iterator[tuple[int, bytes]]:
            try:
                yield from _frames(resp.read)
            except (OSError, ValueError):
                return
            finally:
                resp.close()

        return close, frames()


def bind(src: Path | str, dst: str, *, readonly: bool = True) -> dict[str, object]:
    """One HostConfig.Mounts entry (a bind mount; the daemon refuses a missing source)."""
    return {"Type": "bind", "Source": str(src), "Target": dst, "ReadOnly": readonly}


_MEM_UNITS = {"b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def host_config_limits(flags: list[str]) -> dict[str, object]:
    """The HostConfig fields of `docker run` resource flags (limits.docker_flags, plus the gVisor
    adapter's --ulimit): one source of truth for the limits, and any flag not understood here refuses
    the run (fail closed) instead of being dropped."""
    out: dict[str, object] = {}
    it = iter(flags)
    for flag in it:
        value = next(it, None)
        if value is None:
            raise DockerError(f"resource flag {flag} has no value")
        if flag in ("--memory", "--memory-swap"):
            unit = value[-1].lower() if value[-1].isalpha() else "b"
            number = value[:-1] if value[-1].isalpha() else value
            if unit not in _MEM_UNITS or not number.isdigit():
                raise DockerError(f"resource flag {flag} {value}: not a size")
            out["Memory" if flag == "--memory" else "MemorySwap"] = int(number) * _MEM_UNITS[unit]
        elif flag == "--pids-limit":
            out["PidsLimit"] = int(value)
        elif flag == "--cpus":
            out["NanoCpus"] = round(float(value) * 1e9)
        elif flag == "--cpu-period":
            out["CpuPeriod"] = int(value)
        elif flag == "--cpu-quota":
            out["CpuQuota"] = int(value)
        elif flag == "--ulimit":
            name, _, soft_hard = value.partition("=")
            soft, _, hard = soft_hard.partition(":")
            ulimits = out.setdefault("Ulimits", [])
            assert isinstance(ulimits, list)
            ulimits.append({"Name": name, "Soft": int(soft), "Hard": int(hard or soft)})
        else:
            raise DockerError(f"resource flag {flag} is not supported by the docker adapter")
    return out


def _frames(read: Callable[[int], bytes]) -> Iterator[tuple[int, bytes]]:
    while True:
        head = read(8)
        if len(head) < 8:
            return
        size = int.from_bytes(head[4:8], "big")
        data = read(size) if size else b""
        if len(data) < size:
            if data:
                yield head[0], data
            return
        yield head[0], data


def _message(raw: bytes) -> str:
    """The daemon's error message ({"message": ...}), or the raw body, shortened."""
    try:
        out = json.loads(raw)
        if isinstance(out, dict) and out.get("message"):
            return str(out["message"])[:1500]
    except ValueError:
        pass
    return raw.decode(errors="replace").strip()[:1500] or "(no message)"


def write_all(fd: int, data: bytes) -> bool:
    """Write everything to fd; False once the reader is gone (EPIPE): the caller stops copying."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return False
        view = view[n:]
    return True
