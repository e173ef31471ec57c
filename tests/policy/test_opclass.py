"""The operation-class table (policy/opclass.py): what is a package install, what is a publish, and what is
neither. Each protocol has its recognised spellings (bypass spellings included: case, %2F, double slashes,
encoded or reordered query, HEAD for GET) next to look-alikes that must stay plain requests, so the table
fails both when a protocol stops being recognised and when the classes swallow ordinary traffic."""

from __future__ import annotations

import pytest

from egressgate.policy.opclass import (
    PACKAGE_INSTALL,
    PUBLISH,
    classify,
    classify_overridden,
    path_reading,
    publish_commit,
)
from egressgate.policy.target import parse_target

NPM_ACCEPT = "application/vnd.npm.install-v1+json; q=1.0, application/json; q=0.8, */*"
PEP691 = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
MULTIPART = "multipart/form-data; boundary=xyz"

INS, PUB = PACKAGE_INSTALL, PUBLISH

# (method, path, query, content_type, accept) -> (class, protocol) | None
CASES = [
    # --- PyPI
    ("GET", "/simple/", None, None, None, (INS, "pypi")),
    ("GET", "/simple/requests/", None, None, None, (INS, "pypi")),
    ("GET", "/simple/requests", None, None, None, (INS, "pypi")),
    ("HEAD", "/simple/requests/", None, None, None, (INS, "pypi")),
    ("GET", "/SIMPLE/Requests/", None, None, None, (INS, "pypi")),
    ("GET", "//simple//requests/", None, None, None, (INS, "pypi")),
    ("GET", "/simple%2Frequests/", None, None, None, (INS, "pypi")),
    ("GET", "/simple%252Frequests/", None, None, None, (INS, "pypi")),
    ("GET", "/root/pypi/+simple/requests/", None, None, None, (INS, "pypi")),  # devpi
    ("GET", "/api/v4/projects/7/packages/pypi/simple/requests", None, None, None, (INS, "pypi")),  # GitLab
    ("GET", "/anything", None, None, PEP691, (INS, "pypi")),  # PEP 691 by Accept, whatever the path
    ("GET", "/pypi/requests/json", None, None, None, (INS, "pypi")),
    ("GET", "/pypi/requests/2.32.3/json", None, None, None, (INS, "pypi")),
    ("GET", "/packages/ab/cd/requests-2.32.3-py3-none-any.whl", None, None, None, (INS, "pypi")),
    ("GET", "/packages/ab/cd/requests-2.32.3-py3-none-any.whl.metadata", None, None, None, (INS, "pypi")),
    ("GET", "/packages/ab/cd/Requests-2.32.3-PY3-none-any.WHL", None, None, None, (INS, "pypi")),
    ("GET", "/dl/requests-2.32.3.tar.gz", None, None, None, (INS, "pypi")),  # a direct sdist URL, any host
    ("GET", "/dl/pkg-v1.0.zip", None, None, None, (INS, "pypi")),
    ("GET", "/dl/pkg-1.0.tar.gz;type=a", None, None, None, (INS, "pypi")),
    ("POST", "/legacy/", None, MULTIPART, None, (PUB, "pypi")),  # twine, flit, poetry
    ("POST", "/legacy/", None, None, None, (PUB, "pypi")),
    ("POST", "/", None, MULTIPART, None, (PUB, "pypi")),  # pypiserver's upload form at the root
    ("POST", "/upload", ":action=file_upload&protocol_version=1", MULTIPART, None, (PUB, "pypi")),
    ("POST", "/upload", "protocol_version=1&%3Aaction=file%5Fupload", None, None, (PUB, "pypi")),
    ("POST", "/api/v4/projects/7/packages/pypi", None, MULTIPART, None, (PUB, "gitlab")),
    # not PyPI: plain downloads and look-alikes
    ("GET", "/simple/requests/extra/deep", None, None, None, None),
    ("GET", "/docs/simple-guide", None, None, None, None),
    ("GET", "/data.tar.gz", None, None, None, None),
    ("GET", "/report-2024.zip", None, None, None, None),
    ("GET", "/backup-2024-01-01.tar.gz", None, None, None, None),
    ("GET", "/blob/ab12cd34", None, None, None, None),
    ("GET", "/x.whl", None, None, None, None),  # not a wheel file name
    ("GET", "/pypi/requests", None, None, None, None),
    ("POST", "/", None, "application/json", None, None),
    ("POST", "/upload", "action=file_upload", MULTIPART, None, None),
    ("GET", "/legacy/", None, None, None, None),
    # --- npm
    ("GET", "/left-pad", None, None, NPM_ACCEPT, (INS, "npm")),
    ("GET", "/@types%2fnode", None, None, NPM_ACCEPT, (INS, "npm")),
    ("GET", "/left-pad/-/left-pad-1.3.0.tgz", None, None, None, (INS, "npm")),
    ("GET", "/@types/node/-/node-20.1.0.tgz", None, None, None, (INS, "npm")),
    ("HEAD", "/LEFT-PAD/-/left-pad-1.3.0.TGZ", None, None, None, (INS, "npm")),
    ("GET", "/left-pad%2F-%2Fleft-pad-1.3.0.tgz", None, None, None, (INS, "npm")),
    ("GET", "/dl/left-pad-1.3.0.tgz", None, None, None, (INS, "npm")),
    ("PUT", "/left-pad", None, "application/json", None, (PUB, "npm")),
    ("PUT", "/pkg", None, None, None, (PUB, "npm")),
    ("PUT", "/@acme%2fwidget", None, "application/json", None, (PUB, "npm")),
    ("PUT", "/@acme%2Fwidget", None, None, None, (PUB, "npm")),
    ("PUT", "/@acme/widget", None, None, None, (PUB, "npm")),
    ("PUT", "//Left-Pad", None, None, None, (PUB, "npm")),
    ("PUT", "/-/package/left-pad/dist-tags/latest", None, None, None, (PUB, "npm")),
    ("DELETE", "/left-pad/-rev/3-abc", None, None, None, (PUB, "npm")),
    ("PUT", "/api/v4/projects/7/packages/npm/widget", None, None, None, (PUB, "gitlab")),
    # not npm: a JSON API read, a REST update two levels deep, a plain tarball
    ("GET", "/left-pad", None, None, "application/json", None),
    ("PUT", "/users/42", None, "application/json", None, None),
    ("PUT", "/v1/items/x", None, None, None, None),
    ("GET", "/left-pad/-/readme.txt", None, None, None, None),
    ("GET", "/release.tgz", None, None, None, None),
    # --- Go module proxy
    ("GET", "/golang.org/x/text/@v/list", None, None, None, (INS, "go")),
    ("GET", "/golang.org/x/text/@v/v0.14.0.info", None, None, None, (INS, "go")),
    ("GET", "/golang.org/x/text/@v/v0.14.0.mod", None, None, None, (INS, "go")),
    ("GET", "/golang.org/x/text/@v/v0.14.0.zip", None, None, None, (INS, "go")),
    ("GET", "/github.com/!azure/go/@latest", None, None, None, (INS, "go")),
    ("GET", "/golang.org/x/text%2F@v%2Flist", None, None, None, (INS, "go")),
    ("GET", "/sumdb/sum.golang.org/lookup/golang.org/x/text@v0.14.0", None, None, None, (INS, "go")),
    ("GET", "/golang.org/x/text/@v/notes.txt", None, None, None, None),
    # --- crates.io
    ("GET", "/se/rd/serde", None, None, None, (INS, "cargo")),
    ("GET", "/3/s/syn", None, None, None, (INS, "cargo")),
    ("GET", "/2/cc", None, None, None, (INS, "cargo")),
    ("GET", "/1/a", None, None, None, (INS, "cargo")),
    ("GET", "/SE/RD/Serde", None, None, None, (INS, "cargo")),
    ("GET", "/api/v1/crates/serde/1.0.200/download", None, None, None, (INS, "cargo")),
    ("GET", "/crates/serde/serde-1.0.200.crate", None, None, None, (INS, "cargo")),
    ("PUT", "/api/v1/crates/new", None, None, None, (PUB, "cargo")),
    ("GET", "/se/xx/serde", None, None, None, None),  # not the name's own prefix
    ("GET", "/3/x/syn", None, None, None, None),
    ("GET", "/api/v1/crates/serde", None, None, None, None),  # metadata page, not a download
    # --- RubyGems
    ("GET", "/gems/rails-7.1.0.gem", None, None, None, (INS, "rubygems")),
    ("GET", "/api/v1/dependencies", "gems=rails,rack", None, None, (INS, "rubygems")),
    ("GET", "/info/rails", None, None, None, (INS, "rubygems")),
    ("GET", "/versions", None, None, None, (INS, "rubygems")),
    ("GET", "/specs.4.8.gz", None, None, None, (INS, "rubygems")),
    ("GET", "/quick/Marshal.4.8/rails-7.1.0.gemspec.rz", None, None, None, (INS, "rubygems")),
    ("POST", "/api/v1/gems", None, "application/octet-stream", None, (PUB, "rubygems")),
    ("GET", "/info/refs", None, None, None, None),  # git at a root, not the compact index
    ("GET", "/docs/versions", None, None, None, None),
    # --- Debian / apt
    ("GET", "/debian/dists/bookworm/InRelease", None, None, None, (INS, "apt")),
    ("GET", "/debian/dists/bookworm/Release.gpg", None, None, None, (INS, "apt")),
    ("GET", "/debian/dists/bookworm/main/binary-amd64/Packages.xz", None, None, None, (INS, "apt")),
    ("GET", "/debian/dists/bookworm/main/binary-amd64/by-hash/SHA256/ab12", None, None, None, (INS, "apt")),
    ("GET", "/debian/pool/main/c/curl/curl_7.88.1-10_amd64.deb", None, None, None, (INS, "apt")),
    ("HEAD", "/debian//POOL/main/c/curl/curl_7.88.1-10_amd64.DEB", None, None, None, (INS, "apt")),
    ("GET", "/debian/dists/", None, None, None, None),
    # --- git smart HTTP
    ("GET", "/acme/app.git/info/refs", "service=git-receive-pack", None, None, (PUB, "git")),
    ("GET", "/acme/app.git/info/refs", "x=1&service=git-receive-pack", None, None, (PUB, "git")),
    ("GET", "/acme/app.git/info/refs", "SERVICE=Git-Receive-Pack", None, None, (PUB, "git")),
    ("GET", "/acme/app.git/info/refs", "service=git%2Dreceive%2Dpack", None, None, (PUB, "git")),
    ("GET", "/acme/app.git/info/refs", "service=git%252Dreceive%252Dpack", None, None, (PUB, "git")),
    ("HEAD", "/acme/app.git/info/refs", "service=git-receive-pack", None, None, (PUB, "git")),
    ("POST", "/acme/app.git/git-receive-pack", None, "application/x-git-receive-pack-request", None, (PUB, "git")),
    ("POST", "/acme/app.git/GIT-RECEIVE-PACK", None, None, None, (PUB, "git")),
    ("POST", "/acme/app.git%2Fgit-receive-pack", None, None, None, (PUB, "git")),
    ("GET", "/acme/app.git/info/refs", "service=git-upload-pack", None, None, None),  # clone / fetch
    ("POST", "/acme/app.git/git-upload-pack", None, None, None, None),
    # --- OCI / Docker registries
    ("POST", "/v2/acme/app/blobs/uploads/", None, None, None, (PUB, "oci")),
    ("POST", "/v2/acme/app/blobs/uploads/", "mount=sha256:ab&from=other", None, None, (PUB, "oci")),
    ("PATCH", "/v2/acme/app/blobs/uploads/5f0e", None, None, None, (PUB, "oci")),
    ("PUT", "/v2/acme/app/blobs/uploads/5f0e", "digest=sha256:ab", None, None, (PUB, "oci")),
    ("PUT", "/v2/acme/app/manifests/latest", None, "application/vnd.oci.image.manifest.v1+json", None, (PUB, "oci")),
    ("PUT", "/V2/Acme/App/Manifests/v1", None, None, None, (PUB, "oci")),
    ("DELETE", "/v2/acme/app/manifests/sha256:ab", None, None, None, (PUB, "oci")),
    ("PUT", "/v2/app/manifests/latest", None, None, None, (PUB, "oci")),
    ("GET", "/v2/acme/app/manifests/latest", None, None, None, None),  # a pull is a download
    ("GET", "/v2/acme/app/blobs/sha256:ab", None, None, None, None),
    ("PUT", "/v2/items", None, None, None, None),
    # --- GitHub / GitLab releases
    ("POST", "/repos/acme/app/releases/42/assets", "name=app.tar.gz", "application/gzip", None, (PUB, "github")),
    ("POST", "/api/uploads/repos/acme/app/releases/42/assets", "name=a", None, None, (PUB, "github")),  # GHE
    ("POST", "/repos/acme/app/releases", None, "application/json", None, (PUB, "github")),
    ("PATCH", "/repos/acme/app/releases/42", None, None, None, (PUB, "github")),
    ("GET", "/repos/acme/app/releases/42/assets", None, None, None, None),
    ("POST", "/repos/acme/app/issues", None, None, None, None),
    ("POST", "/api/v4/projects/7/uploads", None, MULTIPART, None, (PUB, "gitlab")),
    ("POST", "/api/v4/projects/acme%2Fapp/releases", None, None, None, (PUB, "gitlab")),
    ("PUT", "/api/v4/projects/7/packages/generic/app/1.0/app.bin", None, None, None, (PUB, "gitlab")),
    ("GET", "/api/v4/projects/7/releases", None, None, None, None),
    ("POST", "/api/v4/projects/7/issues", None, None, None, None),
    # --- neither: ordinary API traffic
    ("GET", "/", None, None, None, None),
    ("GET", "/v1/models", None, None, None, None),
    ("POST", "/v1/responses", None, "application/json", None, None),
    ("POST", "/upload", None, MULTIPART, None, None),
    ("OPTIONS", "/simple/", None, None, None, None),
    ("TRACE", "/left-pad/-/left-pad-1.3.0.tgz", None, None, None, None),
]


@pytest.mark.parametrize(
    ("method", "path", "query", "ctype", "accept", "expected"),
    CASES,
    ids=[f"{c[0]} {c[1]}{'?' + c[2] if c[2] else ''}" for c in CASES],
)
def test_classify_table(method, path, query, ctype, accept, expected):
    assert classify(method, path, query, ctype, accept) == expected


def test_every_protocol_of_the_docs_is_covered_by_the_table():
    """docs/policy.md lists these protocols; each must have a recognised case above (and a look-alike)."""
    seen = {c[5][1] for c in CASES if c[5] is not None}
    assert seen == {"pypi", "npm", "go", "cargo", "rubygems", "apt", "git", "oci", "github", "gitlab"}
    assert {c[5][0] for c in CASES if c[5] is not None} == {INS, PUB}
    assert sum(c[5] is None for c in CASES) >= 35


def test_npm_marks_its_full_packument_fetches():
    """npm 11 fetches a full packument with a plain `Accept: application/json`: its pacote headers say so."""
    assert classify("GET", "/left-pad", None, None, "application/json") is None
    assert classify("GET", "/left-pad", None, None, "application/json", "packument") == (INS, "npm")
    assert classify("HEAD", "/anything", None, None, None, "tarball") == (INS, "npm")
    assert classify("PUT", "/left-pad", None, "application/json", None, "packument") == (PUB, "npm")
    assert classify("POST", "/-/npm/v1/security/advisories/bulk", None, None, None, None) is None


def test_a_method_override_header_is_read_like_the_method():
    """POST with X-HTTP-Method-Override: PUT is a PUT to frameworks that honour the header."""
    assert classify("POST", "/left-pad") is None  # control: the POST itself is not a publish
    assert classify_overridden("POST", ["put"], "/left-pad") == (PUB, "npm")
    assert classify_overridden("POST", ["GET", " PUT "], "/v2/acme/app/manifests/v1") == (PUB, "oci")
    assert classify_overridden("POST", [], "/left-pad") is None
    assert classify_overridden("GET", ["DELETE"], "/simple/x/") == (INS, "pypi")  # the request's own first


def test_which_publish_request_spends_a_single_use_approval():
    """The commit of a publish spends its approval; the requests that prepare it do not."""
    assert publish_commit("POST", "git", "/a.git/git-receive-pack")
    assert not publish_commit("GET", "git", "/a.git/info/refs")  # push discovery
    assert publish_commit("PUT", "npm", "/left-pad") and publish_commit("POST", "pypi", "/legacy/")
    assert publish_commit("PUT", "oci", "/v2/acme/app/manifests/v1")
    for method in ("POST", "PATCH", "PUT"):
        assert not publish_commit(method, "oci", "/v2/acme/app/blobs/uploads/5f0e")
    assert not publish_commit("PUT", "oci", "/v2/acme/app%2Fblobs%2Fuploads/x")  # the same reading


def test_the_reading_merges_what_servers_merge():
    assert path_reading("//A%2fB;x=1//c%252F") == "/a/b/c/"


def test_parse_target_classifies_like_the_gateway():
    """`policy explain`/`policy test` build facts with parse_target: the issue's example says publish."""
    facts = parse_target("PUT https://registry.example.test/pkg")
    assert (facts.op_class, facts.op_protocol) == ("publish", "npm")
    assert parse_target("GET https://mirror.example/x", accept=PEP691).op_class == "package_install"
    assert parse_target("GET https://mirror.example/x").op_class is None
    assert parse_target("CONNECT registry.example.test:443").op_class is None  # a tunnel has no request yet
    info = parse_target("GET https://git.example/a.git/info/refs?service=git-receive-pack")
    assert (info.op_class, info.op_protocol) == ("publish", "git")
