"""Gateway configuration (`egressgate run --config gateway.yaml`).

Strict pydantic: unknown keys and wrong types are errors with their key path, because a typo in a
security product's config (e.g. `alow_private`) must not silently fall back to a default. Every field
has a default, so `egressgate run` works with no file at all. Paths stay strings and are resolved
relative to the working directory by the `resolved_*` helpers, so the same file works from any caller.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from egressgate.audit.config import AuditSinkConfig
from egressgate.broker.config import BrokerConfig
from egressgate.dns.config import DnsConfig
from egressgate.runtimes.identity import DEFAULT_UID_RANGE, parse_range
from egressgate.safeyaml import YamlError, load_yaml
from egressgate.state.config import StateConfig


class ConfigError(ValueError):
    """The config file is unreadable or invalid; the message names the key path."""


def parse_listen(value: str, *, allow_name: bool = False) -> tuple[str, int]:
    """"host:port" / "[v6]:port" → (host, port). Port 0 means "pick a free port" (tests)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"expected host:port, got {value!r}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port out of range in {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"missing host in {value!r}")
    if not allow_name:
        try:
            ipaddress.ip_address(host)
        except ValueError as exc:
            raise ValueError(f"listen address must be an IP literal, got {host!r}") from exc
    return host, port


def _int_to_float(value: object) -> object:
    # strict mode rejects an int where a float is expected; `timeout: 10` obviously means 10.0
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


Seconds = Annotated[float, BeforeValidator(_int_to_float)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ListenConfig(_Strict):
    proxy: str = "127.0.0.1:8080"
    admin: str = "127.0.0.1:8081"
    dns: str | None = "127.0.0.1:5353"  # the DNS resolver; null turns it off (use 53 when running as root)
    # the transparent listener (gateway/pipeline/transparent.py): runtimes DNAT a sandbox's TCP here; null turns it off
    transparent: str | None = "127.0.0.1:8082"
    # read-only GET /metrics (admin.metrics_token_file), /healthz, /readyz for scrapers and probes in other
    # network namespaces, while the admin API stays on loopback (admin/metrics_listener.py); null: none
    metrics: str | None = None

    @field_validator("proxy", "admin", "dns", "transparent", "metrics")
    @classmethod
    def _valid(cls, value: str | None) -> str | None:
        if value is not None:
            parse_listen(value)
        return value

    @model_validator(mode="after")
    def _distinct(self) -> ListenConfig:
        # mitmproxy runs both on one server manager, which refuses two listeners on one host:port (port 0
        # included: "pick a free port" is still the same spec), so say it here with the key names
        if self.transparent is not None and parse_listen(self.transparent) == parse_listen(self.proxy):
            raise ValueError("listen.transparent must differ from listen.proxy (use another address or port; "
                             "with port 0 for both, another address such as 127.0.0.2)")
        return self


class UpstreamConfig(_Strict):
    # "system" (getaddrinfo) or "host:port" of a DNS server queried directly (UDP, TCP on truncation).
    resolver: str = "system"
    # Extra CA certificates trusted for upstream TLS, ADDED to the system roots.
    ca_bundle: str | None = None
    connect_timeout: Seconds = Field(default=10.0, gt=0, le=300)

    @field_validator("resolver")
    @classmethod
    def _resolver(cls, value: str) -> str:
        if value != "system":
            parse_listen(value)
        return value


class DnsSection(_Strict):
    """The DNS resolver (egressgate/dns/, docs/dns.md); listens on `listen.dns`."""

    # "host:port" of upstream resolvers, tried in order; None = the nameservers of /etc/resolv.conf
    upstreams: list[str] | None = None
    upstream_timeout: Seconds = Field(default=2.0, gt=0, le=30)
    cache_size: int = Field(default=10_000, ge=0)
    cache_min_ttl: int = Field(default=5, ge=0)
    cache_max_ttl: int = Field(default=3600, gt=0)
    negative_ttl: int = Field(default=60, ge=0)
    # policy name for sources no sandbox registered (`sandbox admit --address`); None denies them everything
    unknown_client_policy: str | None = None
    deny_rcode: Literal["NXDOMAIN", "REFUSED"] = "REFUSED"  # for unknown clients
    # where a policy's `network.dns.deny_answer: gateway` points denied names (dns/gateway_answer.py):
    # "auto" = the host end of the asking sandbox's /30 link, an IPv4 address, or "off" (rcode answers)
    gateway_answer: str = "auto"
    # the networks whose clients "auto" answers (sandboxes on a /30 whose host end is the gateway); None:
    # runtime.subnet, the pool `sandbox run` takes its links from
    gateway_answer_networks: list[str] | None = None

    @field_validator("gateway_answer")
    @classmethod
    def _gateway_answer(cls, value: str) -> str:
        if value in ("auto", "off"):
            return value
        try:
            ipaddress.IPv4Address(value)
        except ValueError as exc:
            raise ValueError("gateway_answer: 'auto', 'off' or an IPv4 address") from exc
        return value

    @field_validator("gateway_answer_networks")
    @classmethod
    def _gateway_answer_networks(cls, value: list[str] | None) -> list[str] | None:
        for item in value or ():
            ipaddress.ip_network(item, strict=False)  # ValueError names the problem
        return value

    @field_validator("upstreams")
    @classmethod
    def _upstreams(cls, value: list[str] | None) -> list[str] | None:
        for item in value or ():
            parse_listen(item)
        return value

    def resolver_config(self) -> DnsConfig:
        upstreams = tuple(parse_listen(u) for u in self.upstreams) if self.upstreams is not None else None
        return DnsConfig(
            upstreams=upstreams,
            upstream_timeout=self.upstream_timeout,
            cache_size=self.cache_size,
            cache_min_ttl=self.cache_min_ttl,
            cache_max_ttl=self.cache_max_ttl,
            negative_ttl=self.negative_ttl,
            unknown_client_policy=self.unknown_client_policy,
            deny_rcode=self.deny_rcode,
            gateway_answer=None if self.gateway_answer == "off" else self.gateway_answer,
        ).validate()


class WebsocketSection(_Strict):
    """WebSocket relaying (egressgate/gateway/layers/ws_layer.py)."""

    # The largest message (all fragments of one message, either direction) the gateway holds before
    # relaying it; the fragment that would pass it closes the connection with 1009 `message_too_large`.
    # What a websocket holds is bounded by this value per direction (plus one copy while relaying it).
    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)


class LimitsConfig(_Strict):
    """Connection limits and timeouts of the proxy listener (gateway/pipeline/connguard.py, docs/operations.md).

    mitmproxy closes a connection only after `tcp_timeout` of *inactivity*, so a client sending one
    header byte now and then (slow loris) held a connection forever; these bound every phase in which
    the gateway waits for the client. Defaults are loose enough for any normal client."""

    # accept (or the end of the client's TLS handshake in a tunnel) -> request headers complete
    header_timeout: Seconds = Field(default=30.0, gt=0, le=3600)
    # CONNECT answered -> the client's TLS handshake is complete; restarted once at the ClientHello,
    # because the gateway then fetches the upstream certificate (bounded by upstream.connect_timeout)
    tls_handshake_timeout: Seconds = Field(default=30.0, gt=0, le=3600)
    # a kept-alive connection with no request in flight -> the next request's headers are complete
    keepalive_timeout: Seconds = Field(default=120.0, gt=0, le=86400)
    # bytes of one HTTP/1 head the gateway buffers: a request head over it gets 431, an upstream's
    # response head over it a 502 (http_limits.py, http1_framing.py)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    # bytes of TLS records the gateway buffers for a client's ClientHello (announced size included):
    # over it, a fatal TLS alert and close (tls_limits.py). Real ClientHellos are under 8 KiB; OpenSSL
    # itself refuses a ClientHello over ~128 KiB, hence the upper bound.
    max_client_hello_bytes: int = Field(default=64 * 1024, ge=8 * 1024, le=128 * 1024)
    # mitmproxy's inactivity timeout for any connection (request bodies, tunnels, WebSockets)
    idle_timeout: int = Field(default=600, gt=0, le=86400)
    # connections from one source address that have not (yet) identified a sandbox
    max_pending_per_source: int = Field(default=256, gt=0)
    # identified connections of one sandbox open at the same time
    max_connections_per_sandbox: int = Field(default=512, gt=0)
    # audit records per second per (reason, source) for refused/closed connections; more are counted
    # and written as one summary record per second with egressgate.suppressed = count
    audit_per_second: int = Field(default=10, gt=0)


class RuntimeSection(_Strict):
    """What `egressgate sandbox run` needs from the gateway (egressgate/runtimes/, docs/runtimes.md). The
    running gateway publishes these in `var_dir/gateway.json`, so `sandbox run` never loads this model."""

    # each run gets a /30 of it (host end = the sandbox's gateway, resolver and proxy address). It must
    # not overlap a network the gateway host routes to, or that network becomes unreachable from it.
    subnet: str = "198.18.128.0/17"
    # run records (for `sandbox gc`), address slots, generated /etc files of each run
    state_dir: str = "/run/egressgate"
    # the Docker daemon of `--runtime docker|gvisor` (unix:///path only: runtimes/dockerapi.py talks to a
    # local daemon over its socket); None: the DOCKER_HOST of `sandbox run`, else unix:///var/run/docker.sock
    docker_host: str | None = None
    # each run's own host uid/gid (inclusive "FIRST-LAST"; runtimes/identity.py): never the host's own
    # ids 0-65535; gateways sharing a host need disjoint ranges
    uid_range: str = DEFAULT_UID_RANGE

    @field_validator("uid_range")
    @classmethod
    def _uid_range(cls, value: str) -> str:
        parse_range(value)  # ValueError names runtime.uid_range and the problem
        return value

    @field_validator("docker_host")
    @classmethod
    def _docker_host(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("unix:///"):
            raise ValueError(f"runtime.docker_host must be a local daemon's unix socket (unix:///path/to/docker.sock)"
                             f"; tcp://, ssh:// and fd:// are not supported, got {value!r}")
        return value

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, value: str) -> str:
        net = ipaddress.ip_network(value, strict=True)  # ValueError names the problem
        if net.version != 4 or net.prefixlen > 30:
            raise ValueError(f"runtime.subnet must be an IPv4 network of /30 or larger, got {value!r}")
        return value


class DenySection(_Strict):
    """How refusals reach clients (docs/policy.md, "What the agent sees")."""

    # A CONNECT refused by the policy (or an address check) is accepted, its TLS intercepted with a leaf of
    # the gateway CA, and every request inside answered with the deny body; nothing is ever forwarded
    # (gateway/pipeline/refused_tunnel.py). False: the CONNECT itself gets the 403, which most clients never show.
    connect_in_tunnel: bool = True


class AdminConfig(_Strict):
    token_file: str | None = None  # default: var_dir/admin.token
    # the only credential listen.metrics accepts (read-only: GET /metrics); the operator provides it
    metrics_token_file: str | None = None


class GatewayConfig(_Strict):
    listen: ListenConfig = ListenConfig()
    policy: str = "./policies"
    var_dir: str = "./var"
    ca_dir: str | None = None
    upstream: UpstreamConfig = UpstreamConfig()
    audit: AuditSinkConfig = AuditSinkConfig()
    dns: DnsSection = DnsSection()
    admin: AdminConfig = AdminConfig()
    websocket: WebsocketSection = WebsocketSection()
    broker: BrokerConfig = BrokerConfig()  # credential broker; the local backend is the default
    limits: LimitsConfig = LimitsConfig()  # connection limits and timeouts of the proxy listener
    runtime: RuntimeSection = RuntimeSection()  # `sandbox run`: address pool and state dir
    state: StateConfig = StateConfig()  # sandbox registry + counters: memory (one process) or redis (shared)
    deny: DenySection = DenySection()  # how refusals are delivered to clients

    @model_validator(mode="after")
    def _metrics_pair(self) -> GatewayConfig:
        # one without the other is a key that does nothing: a scraper would get 404s or an open listener
        if (self.listen.metrics is None) != (self.admin.metrics_token_file is None):
            raise ValueError("listen.metrics and admin.metrics_token_file go together: the metrics listener "
                             "accepts only that token, and the token opens nothing else")
        return self

    # Resolved paths: one place decides the defaults so the CLI, the admin API and tests agree.
    def var_path(self) -> Path:
        return Path(self.var_dir)

    def ca_path(self) -> Path:
        return Path(self.ca_dir) if self.ca_dir else self.var_path() / "ca"

    def audit_path(self) -> Path | None:
        """The local audit file (None when audit goes only to an OTLP collector)."""
        return self.audit.file_path(self.var_path())

    def admin_token_path(self) -> Path:
        return Path(self.admin.token_file) if self.admin.token_file else self.var_path() / "admin.token"

    def broker_config(self) -> BrokerConfig:
        """The broker config with the local key dir under var_dir unless set explicitly."""
        if "local_key_dir" in self.broker.model_fields_set:
            return self.broker
        return self.broker.model_copy(update={"local_key_dir": str(self.var_path() / "keys")})

    def runtime_path(self) -> Path:
        """Where `run` records its bound addresses so `sandbox admit` finds a port-0 gateway."""
        return self.var_path() / "gateway.json"


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"{source}: {loc}: {err['msg']}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> GatewayConfig:
    """Load and validate; `None` gives the embedded defaults. `overrides` (e.g. `--policy`, `--listen-proxy`)
    win; a mapping value is merged into the file's section of that name."""
    data: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read config: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: config is not UTF-8: {exc}") from None
        try:
            loaded = load_yaml(text)
        except YamlError as exc:  # complex keys, deep nesting, alias bombs, duplicates: refused, never a crash
            raise ConfigError(f"{source}: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: <root>: expected a mapping")
        data = loaded
    if overrides:  # one level deep: `{"listen": {"proxy": ...}}` replaces that key, not the whole section
        data = {**data, **{key: {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict)
                           else value for key, value in overrides.items()}}
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from exc
