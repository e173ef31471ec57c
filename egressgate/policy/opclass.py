"""Operation classes: which HTTP requests install a package and which publish something, by protocol.

`execution.package_install` and `require_approval_for: [publish]` are controls over *what a request does*,
not over where it goes: a rule that allows GET on a mirror still must not let `pip install` through under
`package_install: deny`, and a rule that allows PUT on a registry still must not let `npm publish` through
without an operator. So the gateway recognises the wire protocols of package managers and publishing
clients here, from the request line and two headers, whatever the host is called (a private mirror, a
GitLab instance, a registry on 127.0.0.1 are all recognised). docs/policy.md ("Package installs",
"Publishing") lists exactly what is and is not recognised.

Pure and cheap (no I/O, a few string operations for the common request that is neither): the gateway
calls `classify()` once per HTTP request and puts the answer on `Facts` (`op_class`, `op_protocol`);
decide() enforces it. Matching is on a *reading* of the path chosen to catch spellings servers accept:
percent-escapes decoded (twice, so `%252F` too), lower case, repeated slashes merged, `;params` dropped;
the query's keys and values are decoded the same way and may come in any order; HEAD is read like GET.
Recognising more than a server would act on only ever asks for an approval or refuses: the classes are
enforced on requests the network rules already allow, never used to allow anything.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus

PACKAGE_INSTALL = "package_install"
PUBLISH = "publish"
OP_CLASSES = (PACKAGE_INSTALL, PUBLISH)

Classified = tuple[str, str]  # (operation class, protocol), e.g. ("publish", "npm")

_READ = frozenset({"GET", "HEAD"})
_WRITE = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_SLASHES = re.compile(r"/{2,}")
_PARAMS = re.compile(r";[^/]*")
# PEP 427 wheel: name-version(-build)?-python-abi-platform.whl (at least four dashes)
_WHEEL_PARTS = 5
_ARCHIVES = (".tar.gz", ".tar.bz2", ".tar.xz", ".tgz", ".zip", ".egg")
# A versioned distribution file: NAME-VERSION.ext with a dotted version (`pkg-1.0.tar.gz`, `left-pad-1.3.0.tgz`,
# `pkg-v2.1.zip`); `data.tar.gz`, `report-2024.zip` or `/blob/ab12` are plain downloads.
_VERSIONED = re.compile(r"[a-z0-9][a-z0-9._+-]*-v?\d+\.\d+[a-z0-9.+!_-]*\.(?:tar\.gz|tar\.bz2|tar\.xz|tgz|zip|egg)")
_NPM_NAME = re.compile(r"[a-z0-9][a-z0-9._~-]{0,213}")
_NPM_SCOPE = re.compile(r"@[a-z0-9][a-z0-9._~-]{0,213}")
_CRATE = re.compile(r"[a-z0-9_-]{1,64}")
_GITLAB_PUBLISH = frozenset({"packages", "uploads", "releases"})
_RUBYGEMS_FILES = frozenset(
    {
        "specs.4.8.gz",
        "latest_specs.4.8.gz",
        "prerelease_specs.4.8.gz",
        "specs.4.8",
        "latest_specs.4.8",
        "prerelease_specs.4.8",
    }
)


def path_reading(path: str) -> str:
    """The reading the classes are matched on: decoded (twice), lower case, `//` merged, `;params` gone."""
    p = path
    if "%" in p:
        p = unquote(p)
        if "%" in p:
            p = unquote(p)
    if "\\" in p:
        p = p.replace("\\", "/")
    p = p.lower()
    if "//" in p:
        p = _SLASHES.sub("/", p)
    if ";" in p:
        p = _PARAMS.sub("", p)
    return p


def _query_pairs(query: str) -> list[tuple[str, str]]:
    pairs = []
    for part in query.split("&"):
        key, _, value = part.partition("=")
        key, value = unquote_plus(key), unquote_plus(value)
        if "%" in key or "%" in value:
            key, value = unquote_plus(key), unquote_plus(value)
        pairs.append((key.strip().lower(), value.strip().lower()))
    return pairs


def classify(
    method: str | None,
    path: str | None,
    query: str | None = None,
    content_type: str | None = None,
    accept: str | None = None,
    npm_hint: str | None = None,
) -> Classified | None:
    """(class, protocol) for a package-manager or publishing request, None for anything else.

    `method` upper case, `path` an origin-form path without the query (canonical or raw), `query` without
    `?`, `content_type` and `accept` the request's header values (None when absent), `npm_hint` the value
    of npm's `pacote-req-type` header: npm 10+ fetches full packuments with a plain
    `Accept: application/json`, so its own request headers mark them. The host is not an input: the
    classes are recognised by protocol, so a private mirror is a package index too."""
    if method is None or path is None:
        return None
    read = method in _READ
    if not read and method not in _WRITE:
        return None
    if query:
        found = _from_query(method, query)
        if found is not None:
            return found
    p = path_reading(path)
    segs = p.strip("/").split("/") if p != "/" else []
    if read:
        if npm_hint:  # pacote's packument / tarball fetches (npm install, ci, update, exec, view...)
            return PACKAGE_INSTALL, "npm"
        return _install(p, segs, accept)
    return _publish(method, p, segs, content_type)


def publish_commit(method: str | None, protocol: str | None, path: str | None) -> bool:
    """Is this publish request the one that makes the publish happen (and spends a single-use `publish`
    approval)? Every write except the preparatory ones: git's push discovery (`GET info/refs`) and an OCI
    push's blob uploads come before the commit (`POST git-receive-pack`, the manifest `PUT`)."""
    if method is None or method in _READ:
        return False
    return not (protocol == "oci" and "/blobs/" in path_reading(path or "/"))


METHOD_OVERRIDE_HEADERS = ("x-http-method-override", "x-http-method", "x-method-override")


def classify_overridden(
    method: str | None,
    overrides: list[str],
    path: str | None,
    query: str | None = None,
    content_type: str | None = None,
    accept: str | None = None,
    npm_hint: str | None = None,
) -> Classified | None:
    """classify() by the request's method, then by each method an override header names (`POST` with
    `X-HTTP-Method-Override: PUT` is a PUT to frameworks that honour it): a request is a publish if any
    method a server could act on makes it one. `overrides` are those headers' values (usually none)."""
    found = classify(method, path, query, content_type, accept, npm_hint)
    for value in overrides:
        if found is not None:
            break
        found = classify(value.strip().upper(), path, query, content_type, accept, npm_hint)
    return found


def _from_query(method: str, query: str) -> Classified | None:
    q = query.lower()
    if "%" in q or "+" in q:
        q = unquote_plus(unquote_plus(q))
    if "receive-pack" not in q and "file_upload" not in q:
        return None
    for key, value in _query_pairs(query):
        if key == "service" and value == "git-receive-pack":
            return PUBLISH, "git"  # smart-HTTP push discovery: GET info/refs?service=git-receive-pack
        if key == ":action" and value == "file_upload" and method == "POST":
            return PUBLISH, "pypi"
    return None


def _install(p: str, segs: list[str], accept: str | None) -> Classified | None:
    if accept:
        a = accept.lower()
        if "vnd.pypi.simple" in a:  # PEP 691 JSON / HTML simple API
            return PACKAGE_INSTALL, "pypi"
        if "vnd.npm.install" in a:  # npm's abbreviated packument
            return PACKAGE_INSTALL, "npm"
    if not segs:
        return None
    last = segs[-1]
    n = len(segs)
    # Go module proxy: @v/list, @v/VERSION.info|.mod|.zip
    if n >= 2 and segs[-2] == "@v" and (last == "list" or last.endswith((".info", ".mod", ".zip"))):
        return PACKAGE_INSTALL, "go"
    if last == "@latest" or (n >= 2 and segs[0] == "sumdb"):
        return PACKAGE_INSTALL, "go"
    if "." in last:
        found = _install_file(last, segs)
        if found is not None:
            return found
    if "simple" in segs or "+simple" in segs:  # PEP 503: .../simple/ and .../simple/NAME/ (devpi: +simple)
        i = segs.index("simple") if "simple" in segs else segs.index("+simple")
        if n - i <= 2:
            return PACKAGE_INSTALL, "pypi"
    if last == "json" and n >= 3 and (segs[-3] == "pypi" or (n >= 4 and segs[-4] == "pypi")):
        return PACKAGE_INSTALL, "pypi"  # JSON API: /pypi/NAME/json, /pypi/NAME/VERSION/json
    if "dists" in segs and n - segs.index("dists") >= 3:  # apt: dists/SUITE/Release|InRelease|.../Packages*
        return PACKAGE_INSTALL, "apt"
    if last == "download" and n >= 4 and segs[-4] == "crates":  # crates.io: /api/v1/crates/NAME/VER/download
        return PACKAGE_INSTALL, "cargo"
    if _sparse_index(segs):
        return PACKAGE_INSTALL, "cargo"
    if p in ("/versions", "/api/v1/dependencies", "/api/v1/dependencies.json") or (
        n == 2 and segs[0] == "info" and last != "refs"
    ):  # compact index /info/NAME (not git's info/refs)
        return PACKAGE_INSTALL, "rubygems"
    if n >= 2 and segs[-2] == "dependencies" and segs[0] == "api":
        return PACKAGE_INSTALL, "rubygems"
    return None


def _install_file(last: str, segs: list[str]) -> Classified | None:
    if last.endswith((".whl", ".whl.metadata")) and last.count("-") >= _WHEEL_PARTS - 1:
        return PACKAGE_INSTALL, "pypi"
    if last.endswith((".deb", ".udeb")):
        return PACKAGE_INSTALL, "apt"
    if last.endswith(".gem") or last.endswith(".gemspec.rz") or last in _RUBYGEMS_FILES:
        return PACKAGE_INSTALL, "rubygems"
    if last.endswith(".crate"):
        return PACKAGE_INSTALL, "cargo"
    if last.endswith(".tgz") and "-" in segs[:-1]:  # npm tarball: NAME/-/NAME-VERSION.tgz
        return PACKAGE_INSTALL, "npm"
    if last.endswith(_ARCHIVES) and _VERSIONED.fullmatch(last):
        return PACKAGE_INSTALL, "npm" if last.endswith(".tgz") else "pypi"
    return None


def _sparse_index(segs: list[str]) -> bool:
    """Cargo's sparse index layout: 1/N, 2/NN, 3/N/NNN, AB/CD/ABCD... (the name's own prefix)."""
    n = len(segs)
    if n < 2 or len(segs[-2]) > 2:  # the parent is "1", "2", a first letter or two letters
        return False
    name = segs[-1]
    if not _CRATE.fullmatch(name):
        return False
    size = len(name)
    if size == 1:
        return segs[-2] == "1"
    if size == 2:
        return segs[-2] == "2"
    if n < 3:
        return False
    if size == 3:
        return segs[-3] == "3" and segs[-2] == name[0]
    return segs[-3] == name[:2] and segs[-2] == name[2:4]


def _publish(method: str, p: str, segs: list[str], content_type: str | None) -> Classified | None:
    if not segs:
        if method == "POST" and content_type and content_type.lower().startswith("multipart/form-data"):
            return PUBLISH, "pypi"  # an upload form at an index root (pypiserver; twine's `:action` is in it)
        return None
    last = segs[-1]
    n = len(segs)
    if last == "git-receive-pack":
        return PUBLISH, "git"
    if "v2" in segs:
        found = _oci(method, segs[segs.index("v2") + 1 :])
        if found is not None:
            return found
    if method == "PUT":
        if n == 1 and _NPM_NAME.fullmatch(last):  # npm publish / deprecate: PUT /NAME (a packument)
            return PUBLISH, "npm"
        if n == 2 and _NPM_SCOPE.fullmatch(segs[0]) and _NPM_NAME.fullmatch(last):  # PUT /@scope%2fNAME
            return PUBLISH, "npm"
        if p.endswith("/api/v1/crates/new"):  # cargo publish
            return PUBLISH, "cargo"
    if "dist-tags" in segs and method in ("PUT", "DELETE", "POST"):  # npm dist-tag add|rm
        return PUBLISH, "npm"
    if method == "DELETE" and "-rev" in segs:  # npm unpublish
        return PUBLISH, "npm"
    if method == "POST":
        if last == "legacy":  # PyPI's upload endpoint (twine, flit, poetry publish)
            return PUBLISH, "pypi"
        if p.endswith("/api/v1/gems"):  # gem push
            return PUBLISH, "rubygems"
    if "releases" in segs and "repos" in segs:
        found = _github_release(method, segs)
        if found is not None:
            return found
    # GitLab: /api/v4/projects/ID/(packages|uploads|releases)/...; ID may be an encoded path (acme%2Fapp)
    if (
        "projects" in segs
        and method in ("POST", "PUT", "PATCH")
        and any(seg in _GITLAB_PUBLISH for seg in segs[segs.index("projects") + 2 :])
    ):
        return PUBLISH, "gitlab"
    return None


def _oci(method: str, rest: list[str]) -> Classified | None:
    """OCI distribution: NAME.../blobs/uploads/[UUID] (POST, PATCH, PUT), NAME.../manifests/REF (PUT,
    DELETE), NAME.../blobs/DIGEST (DELETE)."""
    if len(rest) < 3:
        return None
    if "blobs" in rest:
        i = rest.index("blobs")
        if i >= 1 and len(rest) > i + 1 and rest[i + 1] == "uploads" and method in ("POST", "PATCH", "PUT"):
            return PUBLISH, "oci"
        if i >= 1 and method == "DELETE":
            return PUBLISH, "oci"
    if len(rest) >= 3 and rest[-2] == "manifests" and method in ("PUT", "DELETE"):
        return PUBLISH, "oci"
    return None


def _github_release(method: str, segs: list[str]) -> Classified | None:
    """GitHub (and GitHub Enterprise under /api/v3 or /api/uploads): create or edit a release, upload an
    asset (uploads.github.com /repos/OWNER/REPO/releases/ID/assets)."""
    r = segs.index("repos")
    tail = segs[r + 3 :] if segs[r + 3 : r + 4] == ["releases"] else None
    if tail is None:
        return None
    if method == "POST" and (len(tail) == 1 or (len(tail) == 3 and tail[2] == "assets")):
        return PUBLISH, "github"
    if method == "PATCH" and len(tail) == 2:
        return PUBLISH, "github"
    return None
