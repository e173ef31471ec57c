"""The real gateway inside the network-namespace test world (tests/networld), and sandbox-side clients.

The gateway runs as its real console script (`egressgate run --config CFG`) inside the world's ``gw``
namespace, exactly as an operator would run it; sandboxes are admitted with the real
`egressgate sandbox admit`. Clients run inside the firewalled ``sbx`` namespace: curl for ordinary
requests, raw sockets (created in ``sbx`` via setns) for what curl refuses to send (smuggling, bad
framing, non-HTTP bytes, mismatched SNI/Host).
"""

from __future__ import annotations

import base64
import json
import shlex
import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import tests.networld as nw
from tests.networld import World
from tests.support import cli
from tests.support.http1 import Response, read_all, read_response
from tests.support.launcher import (
    EGRESSGATE,
    complete_lines,
    flatten_otlp,
    host_port,
    launch_in_namespace,
    stop_process,
)

POLICIES = Path(__file__).resolve().parents[1] / "escape" / "policies"  # the escape tests' policies


@dataclass
class Sandbox:
    """An admitted sandbox: what `sandbox admit` printed."""

    id: str
    token: str
    proxy_url: str
    policy: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def auth_header(self) -> str:
        raw = base64.b64encode(f"{self.id}:{self.token}".encode()).decode()
        return f"Basic {raw}"


@dataclass
class Gateway:
    world: World
    tmp: Path
    proc: subprocess.Popen[str]
    config: Path
    proxy: tuple[str, int]
    info: dict[str, Any]
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)
    _stderr: Any = None

    @classmethod
    def start(cls, world: World, tmp: Path, policies: Path = POLICIES, extra_config: dict | None = None,
              launcher: list[str] | None = None) -> Gateway:
        """Start with every policy in `policies`, plus escape-self, which allows the gateway's own
        listeners by rule (so only the self-connection check can refuse them). Its ports are picked
        free inside the private gw namespace before the start, since the policy must name them.
        `launcher` replaces the `egressgate` command (a script that plants a fault, then runs the CLI)."""
        var = tmp / "var"
        var.mkdir(parents=True, exist_ok=True)
        pdir = tmp / "policies"
        pdir.mkdir(exist_ok=True)
        for src in policies.glob("*.yaml"):
            shutil.copy(src, pdir / src.name)
        proxy_port = world.in_ns(world.gw, lambda: _free_port(nw.GW_SBX))
        admin_port = world.in_ns(world.gw, lambda: _free_port("127.0.0.1"))
        dns_port = world.in_ns(world.gw, lambda: _free_port(nw.GW_SBX, udp=True))
        transparent_port = world.in_ns(world.gw, lambda: _free_port("127.0.0.1"))
        (pdir / "escape-self.yaml").write_text(yaml.safe_dump(_self_policy(proxy_port, admin_port)))
        config = {
            "listen": {"proxy": f"{nw.GW_SBX}:{proxy_port}", "admin": f"127.0.0.1:{admin_port}",
                       "dns": f"{nw.GW_SBX}:{dns_port}", "transparent": f"127.0.0.1:{transparent_port}"},
            # cache_min_ttl 0: honour the world's TTL 0, so every sandbox query reaches the world resolver
            # (rebinding answers are really delivered to the gateway, not hidden by a cache floor)
            # gateway_answer_networks: the world's sandbox links (198.18.3.0/24, the transparent namespaces)
            # have the gateway at .1 like a runtime's /30, outside runtime.subnet
            "dns": {"upstreams": [f"{nw.DNS_ADDR}:53"], "cache_min_ttl": 0,
                    "gateway_answer_networks": ["198.18.0.0/15"]},
            "policy": str(pdir),
            "var_dir": str(var),
            "upstream": {"resolver": f"{nw.DNS_ADDR}:53", "ca_bundle": str(world.ca_pem)},
            **(extra_config or {}),
        }
        proc, info, cfg, stderr = launch_in_namespace(world, world.gw, tmp, config, launcher)
        proxy = host_port(info["proxy"])
        world.allow_sandbox_to(*proxy)
        world.allow_sandbox_to(nw.GW_SBX, dns_port)
        gw = cls(world=world, tmp=tmp, proc=proc, config=cfg, proxy=proxy, info=info)
        gw._stderr = stderr
        return gw

    def stop(self) -> None:
        stop_process(self.proc, timeout=10)
        if self._stderr is not None:
            self._stderr.close()

    @property
    def stderr(self) -> str:
        return (self.tmp / "gateway.stderr").read_text()

    @property
    def proxy_url(self) -> str:
        return f"http://{self.proxy[0]}:{self.proxy[1]}"

    @property
    def transparent(self) -> tuple[str, int]:
        """The transparent listener (where a runtime DNATs sandbox TCP), from the startup line."""
        return host_port(self.info["transparent"])

    @property
    def dns(self) -> tuple[str, int]:
        return host_port(self.info["dns"])

    def admit(self, policy: str, address: str | None = None) -> Sandbox:
        """Admit (once per policy) with the real CLI, inside the gateway namespace. `address` registers
        the sandbox's source IP (how the DNS listener identifies it); one sandbox per address."""
        key = f"{policy}@{address}" if address else policy
        if key not in self.sandboxes:
            extra = ("--address", address) if address else ()
            res = self.world.exec(self.world.gw, EGRESSGATE, "sandbox", "admit", "--config", str(self.config),
                                  "--policy", policy, *extra)
            if res.returncode != 0:
                raise RuntimeError(f"sandbox admit failed ({res.returncode}): {res.stdout} {res.stderr}")
            data = json.loads(res.stdout)
            self.sandboxes[key] = Sandbox(id=data["id"], token=data["token"], proxy_url=data["proxy_url"],
                                          policy=policy, env=data.get("env", {}))
        return self.sandboxes[key]

    @property
    def client_ca(self) -> Path:
        """A bundle the sandbox trusts: the gateway CA (for MITM) + the world CA (for passthrough).
        The CA path comes from the real `egressgate ca path`, as an operator would get it."""
        bundle = self.tmp / "client-ca.pem"
        if not bundle.exists():
            res = cli.run([EGRESSGATE, "ca", "path", "--config", str(self.config)], check=True, timeout=30)
            gateway_ca = Path(res.stdout.strip()).read_text()
            bundle.write_text(gateway_ca + self.world.ca_pem.read_text())
        return bundle

    # ------------------------------------------------------------------------------ clients
    def curl(self, sbx: Sandbox, url: str, *args: str, ns: str | None = None, timeout: float = 15) -> Curl:
        """curl through the proxy from the sandbox namespace; returns codes, headers and body."""
        hdr = self.tmp / f"curl-{time.monotonic_ns()}.hdr"
        res = self.world.exec(
            ns or self.world.sbx, "curl", "-gsS", "--max-time", str(int(timeout) - 2), "--cacert",
            str(self.client_ca), "-x", self.proxy_url, "--proxy-user", f"{sbx.id}:{sbx.token}",
            "-D", str(hdr), "-w", "\n%{http_code} %{http_connect}", *args, url, timeout=timeout,
        )
        body, _, codes = res.stdout.rpartition("\n")
        code, _, connect = codes.partition(" ")
        headers = hdr.read_text(errors="replace") if hdr.exists() else ""
        hdr.unlink(missing_ok=True)
        out = Curl(int(code or 0), int(connect or 0), headers, body, res.returncode, res.stderr,
                   shlex.join(["curl", *args, url]))
        if out.connect_status >= 400 and out.denied:
            # curl discards the body of a refused CONNECT: take the decision from the audit trail,
            # matched by the request id the deny response carried.
            out.audit = self.audit_record(out.header("x-egressgate-request-id"))
        return out

    def audit_record(self, request_id: str, timeout: float = 5.0) -> dict[str, Any]:
        """The audit record (attributes flattened) of one decision, waiting for the batched writer."""
        path = self.tmp / "var" / "audit.jsonl"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                for line in complete_lines(path):
                    if request_id and request_id in line:
                        return flatten_otlp(json.loads(line))
            time.sleep(0.1)
        raise AssertionError(f"no audit record for request id {request_id!r} in {path}")

    def connect(self, ns: str | None = None) -> socket.socket:
        """A TCP socket to the proxy created inside the sandbox namespace."""
        def make() -> socket.socket:
            return socket.create_connection(self.proxy, timeout=10)
        return self.world.in_ns(ns or self.world.sbx, make)

    def raw(self, payload: bytes, wait: float = 3.0) -> bytes:
        """Send raw bytes to the proxy from the sandbox; return everything read until close/quiet."""
        with self.connect() as sock:
            sock.sendall(payload)
            return read_all(sock, wait, first=10)

    def tunnel(self, sbx: Sandbox, target: str, read_refusal: bool = True) -> tuple[socket.socket, Response]:
        """CONNECT `target` with the sandbox's identity; returns the socket and the CONNECT response.

        A CONNECT the policy refuses is accepted by default (`deny.connect_in_tunnel`: a 200 that carries
        `X-Egressgate-Decision: deny`, gateway/pipeline/refused_tunnel.py) and its deny is read inside the tunnel. With
        `read_refusal` (the default) such a refusal is read the way a client reads it: one plain request in
        the tunnel, whose answer (the deny body, under the CONNECT's request id) is returned instead of
        the 200. `read_refusal=False`: the CONNECT's own response, whatever it is."""
        sock = self.connect()
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
                     f"Proxy-Authorization: {sbx.auth_header}\r\n\r\n".encode())
        resp = read_response(sock)
        if read_refusal and resp.status == 200 and resp.denied:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n".encode())
            inner = read_response(sock)
            assert inner.headers.get("x-egressgate-request-id") == resp.headers.get("x-egressgate-request-id"), inner
            return sock, inner
        return sock, resp

    def tls(self, sock: socket.socket, sni: str | None, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLSocket:
        """TLS over an open tunnel, presenting `sni` (verification against our bundle, names unchecked:
        the point is what the gateway does with a mismatched SNI, not what the client accepts)."""
        ctx = ssl.create_default_context(cafile=str(self.client_ca))
        ctx.check_hostname = False
        ctx.set_alpn_protocols(list(alpn))
        return ctx.wrap_socket(sock, server_hostname=sni)


@dataclass
class Curl:
    status: int
    connect_status: int
    headers: str
    body: str
    rc: int
    stderr: str
    cmd: str
    audit: dict[str, Any] | None = None

    @property
    def denied(self) -> bool:
        return "x-egressgate-decision: deny" in self.headers.lower()

    def header(self, name: str) -> str:
        """Last value of a response header (across the CONNECT and the inner response blocks)."""
        found = ""
        for line in self.headers.splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip().lower() == name.lower():
                found = value.strip()
        return found

    def deny_body(self) -> dict[str, Any]:
        if self.audit is not None:  # refused CONNECT: the same facts, from the audit record
            return {"error": "egress_denied", "reason": self.audit.get("egressgate.reason"),
                    "request_id": self.audit.get("egressgate.request.id"),
                    "message": self.audit.get("egressgate.message"), "rule": None}
        return json.loads(self.body)

    def __str__(self) -> str:
        return f"{self.cmd}: rc={self.rc} status={self.status} connect={self.connect_status} " \
               f"stderr={self.stderr.strip()!r} headers={self.headers!r} body={self.body[:300]!r}"


def _free_port(host: str, udp: bool = False) -> int:
    """A port free for TCP (and, with `udp`, for UDP too: the DNS listener binds both)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if not udp:
            return port
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port on {host}")


def _self_policy(proxy_port: int, admin_port: int) -> dict[str, Any]:
    rules = [{"id": "gateway-addr", "host": nw.GW_SBX, "ports": [proxy_port, nw.GW_SELF_CANARY_PORT]},
             {"id": "gateway-loopback", "host": "127.0.0.1", "ports": [admin_port, 80]}]
    return {"sandbox": {"name": "escape-self"},
            "network": {"allow_private": [f"{nw.GW_SBX}/32", "127.0.0.1/32"],
                        "https": {"allow": rules},
                        "http": {"allow": [{**r, "id": r["id"] + "-http"} for r in rules]}}}
