"""A minimal Docker Engine API client over the daemon's unix socket (stdlib only).

Why not the docker CLI: each fork of the Go CLI costs 25-40 ms of start-up before it sends one request,
and a `sandbox run` needs six or more (create+start, inspect, logs, wait, inspect, rm): most of the
docker runtime's start-up overhead (loadtests/RESULTS.md). The same requests over the socket cost about
a millisecond each. http.client is already imported by `sandbox run` (urllib, for admission), so this
adds no import time.

Why unix sockets only: a `tcp://` daemon socket without TLS is root on the host for anyone who can reach
it, and egressgate would have to carry the CLI's TLS settings to talk to one safely; `ssh://` needs the
CLI. Both are refused with a message saying so (the daemon must also be local for the adapter's
namespace and cgroup checks).

Every failure is a DockerError naming the call and carrying the daemon's own message, so `sandbox run`
fails closed with exit 120 and one readable line, never a traceback.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote, urlencode

DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
MIN_API = (1, 25)  # HostConfig.Init, Mounts: what containers/create needs
TIMEOUT = 60.0


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


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a unix stream socket (the Host header is a placeholder the daemon ignores)."""

    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class DockerAPI:
    """One daemon. Each request opens its own connection (a unix connect costs microseconds), so
    blocking calls (wait, logs) can run in threads beside the others."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.path = socket_path(host)
        self._prefix: str | None = None

    # ------------------------------------------------------------------------------ transport
    def _open(self, method: str, url: str, body: object | None, timeout: float | None,
              call: str) -> tuple[_UnixConnection, http.client.HTTPResponse]:
        conn = _UnixConnection(self.path, timeout)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, url, body=data, headers=headers)
            return conn, conn.getresponse()
        except TimeoutError:
            conn.close()
            raise
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise DockerError(f"docker API {call}: cannot reach the daemon at {self.host}: {exc}") from None

    def _url(self, path: str, query: dict[str, object] | None) -> str:
        if self._prefix is None:
            self._prefix = f"/v{self._negotiate()}"
        qs = f"?{urlencode(query)}" if query else ""
        return f"{self._prefix}{path}{qs}"

    def _negotiate(self) -> str:
        """The daemon's own API version (GET /_ping's API-Version header, as the CLI negotiates it): every
        field sent here exists since 1.25, and a daemon's minimum may be above any version pinned today."""
        conn, resp = self._open("GET", "/_ping", None, TIMEOUT, "ping")
        try:
            resp.read()
            version = resp.getheader("API-Version") or ""
        finally:
            conn.close()
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
             body: object | None = None, timeout: float | None = TIMEOUT, ok: tuple[int, ...] = ()) -> object:
        """One request; the decoded JSON answer (None when empty). Statuses >= 400 not in `ok` raise."""
        conn, resp = self._open(method, self._url(path, query), body, timeout, call)
        try:
            raw = resp.read()
        except TimeoutError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise DockerError(f"docker API {call}: the connection to {self.host} broke: {exc}") from None
        finally:
            conn.close()
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
                        timeout=timeout)
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
        conn, resp = self._open("GET", url, None, timeout, f"logs {ref}")
        try:
            if resp.status >= 400:
                raise DockerError(f"docker API logs {ref} failed (HTTP {resp.status}): {_message(resp.read())}")
            yield from _frames(resp.read)
        finally:
            conn.close()

    def log_stream(self, ref: str) -> tuple[Callable[[], None], Iterator[tuple[int, bytes]]]:
        """Follow the logs in a thread that can be stopped: (close, frames). close() shuts the socket
        down, which ends the iteration in the other thread."""
        url = self._url(f"/containers/{quote(ref)}/logs", {"stdout": "1", "stderr": "1", "follow": "1"})
        conn, resp = self._open("GET", url, None, None, f"logs {ref}")
        if resp.status >= 400:
            message = _message(resp.read())
            conn.close()
            raise DockerError(f"docker API logs {ref} failed (HTTP {resp.status}): {message}")

        def close() -> None:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        def frames() -> Iterator[tuple[int, bytes]]:
            try:
                yield from _frames(resp.read)
            except (OSError, ValueError, http.client.HTTPException):
                return
            finally:
                conn.close()

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
