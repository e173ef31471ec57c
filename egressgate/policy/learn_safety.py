"""What `policy learn` never proposes, whatever the audit trail says.

The audit trail is written by the gateway but its contents (hosts, paths, methods) are chosen by the
sandbox, which may be compromised: a learner that turns "what the agent tried" into "what the agent may do"
must refuse to launder an attack into a rule. Every refusal is a short reason that `policy learn`
reports with a count ("not learnable"), never a silent drop.

* Hosts: only canonical names (policy.canon) that are not cloud metadata names, not special-use or
  single-label names (those resolve through search domains or local resolvers to internal services), and
  not IP literals or names whose *recorded* addresses (dial addresses, pinned address, DNS answers) are
  anything but global (policy.addr.classify: private, loopback, link-local, metadata, CGNAT, ULA, and the
  IPv4-mapped / NAT64 / 6to4 / Teredo forms of them; decimal and hex IPv4 spellings are already
  canonicalized to dotted quads by canon_host). The gateway still checks addresses at request time: a
  learned name that later resolves to a private address is refused then (`address_forbidden`).
* Wildcards: `*.P` only over >= 2 observed subdomains (learn.py) and never when P is a single label, a
  special-use name or a public suffix. The public-suffix list below is a SMALL built-in list of common
  suffixes (not the full Public Suffix List: no new dependency); a parent it does not know is still only
  used when two observed hosts share it and the learned rules are otherwise identical.
* Paths: canonical, expressible as an exact policy path (no literal `*`, which a policy path reads as a
  wildcard), and holding no credential: no phantom token (`egph_...`, as sent or as redacted by the
  gateway) and none of a few common secret shapes (a small built-in list: GitHub, GitLab, Slack, OpenAI /
  Anthropic style `sk-`, AWS access key ids, JWTs).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from egressgate.policy.addr import classify, is_metadata_hostname
from egressgate.policy.canon import CanonError, canon_host, canon_method, canon_path, parse_ip_literal
from egressgate.policy.globs import GlobError, parse_host_pattern, parse_path_glob
from egressgate.policy.limits import MAX_PATH_SEGMENTS

MAX_LEARNED_PATH = 4096  # characters of one learned exact path

# Names that by convention resolve to the local host or to internal services (RFC 6761 localhost, RFC 6762
# .local, RFC 8375 .home.arpa, .internal, common private zones) or that are not Internet names at all
# (RFC 7686 .onion, .alt, reverse-DNS .arpa): never learned, neither as a host nor as a wildcard parent.
# (.test / .example / .invalid, reserved for testing and documentation, are not in this list: they name no
# internal service, and the address checks apply to them like to any name.)
SPECIAL_USE_SUFFIXES = frozenset(
    {"localhost", "local", "internal", "intranet", "corp", "home", "lan", "private", "home.arpa", "arpa",
     "onion", "localdomain", "alt"}
)

# A small built-in list of common public suffixes: a `*.P` wildcard is never proposed for these.
PUBLIC_SUFFIXES = frozenset(
    {
        # generic and country-code second levels in common use
        "co.uk", "org.uk", "ac.uk", "gov.uk", "me.uk", "ltd.uk", "plc.uk", "net.uk", "co.jp", "ne.jp", "or.jp",
        "ac.jp", "go.jp", "com.au", "net.au", "org.au", "edu.au", "gov.au", "com.br", "net.br", "org.br",
        "com.cn", "net.cn", "org.cn", "gov.cn", "co.in", "net.in", "org.in", "co.nz", "org.nz", "co.za",
        "com.mx", "com.ar", "com.tr", "com.tw", "com.hk", "com.sg", "co.kr", "or.kr", "co.il", "com.ua",
        "com.pl", "eu.org", "us.com", "uk.com", "gv.at", "co.at", "or.at",
        # shared hosting / cloud platforms (anyone can get a subdomain)
        "github.io", "githubusercontent.com", "gitlab.io", "amazonaws.com", "s3.amazonaws.com",
        "compute.amazonaws.com", "elb.amazonaws.com", "cloudfront.net", "azurewebsites.net", "azureedge.net",
        "blob.core.windows.net", "cloudapp.net", "cloudapp.azure.com", "appspot.com", "run.app", "web.app",
        "firebaseapp.com", "firebaseio.com", "herokuapp.com", "vercel.app", "now.sh", "netlify.app",
        "netlify.com", "pages.dev", "workers.dev", "r2.dev", "fly.dev", "onrender.com", "ngrok.io",
        "ngrok-free.app", "ngrok.app", "repl.co", "glitch.me", "surge.sh", "blogspot.com", "wordpress.com",
        "readthedocs.io", "trycloudflare.com", "duckdns.org", "no-ip.org", "dyndns.org", "hf.space",
        "storage.googleapis.com", "googleusercontent.com", "cloudfunctions.net", "digitaloceanspaces.com",
        "oraclecloud.com", "myshopify.com", "azurestaticapps.net", "supabase.co",
    }
)

# Secret shapes never written into a learned path (a path that holds one is "not learnable").
_SECRET = re.compile(
    r"egph_|egph%5f|\[REDACTED\]"  # egressgate phantom tokens, as sent or redacted by the gateway
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}"
    r"|xox[abposr]-[A-Za-z0-9-]{10,}|sk-[A-Za-z0-9_-]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.",
    re.IGNORECASE,
)
_TCHAR_METHOD = re.compile(r"[A-Z][A-Z0-9_-]{0,31}", re.ASCII)


def _special(host: str) -> bool:
    return any(host == s or host.endswith("." + s) for s in SPECIAL_USE_SUFFIXES)


def host_problem(host: object) -> str | None:
    """Why `host` (as recorded) is never proposed, or None."""
    if not isinstance(host, str) or not host:
        return "malformed host"
    try:
        canonical = canon_host(host)
    except CanonError:
        return "malformed host"
    if canonical != host:
        return "malformed host"  # the gateway records canonical hosts; anything else is not ours to trust
    if is_metadata_hostname(host):
        return "metadata host"
    literal = parse_ip_literal(host)
    if literal is not None:
        cls = classify(literal)
        return None if cls.is_global else f"{cls.addr_class} address"
    if "." not in host:
        return "single-label name"
    if _special(host):
        return "special-use name"
    try:
        parse_host_pattern(host, allow_any=False)
    except GlobError:
        return "malformed host"
    return None


def address_problem(addresses: Iterable[object]) -> str | None:
    """Why recorded addresses forbid their host (first non-global one), or None."""
    for raw in addresses:
        try:
            address = ipaddress.ip_address(str(raw).split("%", 1)[0])
        except ValueError:
            continue
        cls = classify(address)
        if not cls.is_global:
            return f"resolves to a {cls.addr_class} address"
    return None


def wildcard_parent_ok(parent: str) -> bool:
    """Whether `*.parent` may be proposed at all (the >= 2 observed subdomains rule is learn.py's)."""
    return (
        "." in parent
        and parent not in PUBLIC_SUFFIXES
        and not _special(parent)
        and parse_ip_literal(parent) is None
        and host_problem(parent) is None
    )


def path_problem(path: object) -> str | None:
    """Why a recorded path cannot be an exact path of a learned rule, or None."""
    if not isinstance(path, str) or not path.startswith("/"):
        return "path not expressible"
    if _SECRET.search(path):
        return "credential in path"
    if "*" in path:
        return "path not expressible"  # a literal '*' would read as a wildcard in a policy path
    if path.count("/") > MAX_PATH_SEGMENTS or len(path) > MAX_LEARNED_PATH:
        return "path too long for a policy"  # the loader's limit (policy/limits.py), and a readable file
    try:
        if canon_path(path) != path:
            return "path not expressible"
        glob = parse_path_glob(path)
    except (CanonError, GlobError):
        return "path not expressible"
    return None if glob.exact == path else "path not expressible"


def method_problem(method: object) -> str | None:
    if not isinstance(method, str) or not _TCHAR_METHOD.fullmatch(method):
        return "malformed method"
    try:
        return None if canon_method(method) == method else "malformed method"
    except CanonError:
        return "malformed method"
