"""Package installs and publishing, enforced by protocol on real clients through the real gateway.

Every policy here allows ANY method and path on the package server (`pkgs.test`, loopback): the network
rules alone would let everything through, so each refusal comes from the operation class
(policy/opclass.py). Each refusal has its positive control: the same client, the same server, succeeding
under `package_install: allow` (or without `publish` approval), or after an operator's approval. The server
records every request it gets, so "refused" also means "the upstream saw nothing"."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.approvals.harness import admin, approve, records
from tests.support.gwworld import Gateway, Sandbox, World, auth
from tests.support.http1 import read_reply
from tests.support.launcher import labels_of, launch_loopback, stop_gateway, write_policies
from tests.support.loopback import server_context
from tests.support.pkgservers import WHEEL_NAME, PkgServer, client_env
from tests.support.waiting import wait_for

VENV_BIN = Path(sys.executable).parent
TIMEOUT = 180


def _policy(name: str, port: int, tls_port: int, package_install: str, kinds: list[str]) -> dict:
    return {
        "sandbox": {"name": name},
        "execution": {"package_install": package_install, "require_approval_for": kinds},
        "network": {
            "allow_private": ["127.0.0.1/32"],
            "http": {"allow": [{"id": "pkgs-any", "host": "pkgs.test", "ports": [port]}]},
            "https": {"allow": [{"id": "pkgs-tls-any", "host": "pkgs-tls.test", "ports": [tls_port]}]},
        },
    }


@pytest.fixture(scope="module")
def pkgs(tmp_path_factory: pytest.TempPathFactory, world: World) -> Iterator[PkgServer]:
    server = PkgServer(tmp_path_factory.mktemp("pkgs")).start()
    world.dns.records["pkgs.test"] = "127.0.0.1"
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pkgs_tls(tmp_path_factory: pytest.TempPathFactory, world: World) -> Iterator[PkgServer]:
    """The same protocols over HTTPS (certificate from the world's CA, which the gateway trusts upstream):
    requests reach it only inside an intercepted CONNECT tunnel, decided one by one."""
    server = PkgServer(tmp_path_factory.mktemp("pkgs-tls"), host="pkgs-tls.test")
    server.start(server_context(world.ca.issue_cert("pkgs-tls.test")))
    world.dns.records["pkgs-tls.test"] = "127.0.0.1"
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gw(
    world: World, pkgs: PkgServer, pkgs_tls: PkgServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("pkgs-gw")
    ports = (pkgs.port, pkgs_tls.port)
    docs = {
        "pk-deny": _policy("pk-deny", *ports, "deny", ["publish"]),
        "pk-allow": _policy("pk-allow", *ports, "allow", []),
        "pk-approval": _policy("pk-approval", *ports, "approval", ["publish"]),
    }
    policy_dir = write_policies(tmp / "policies", docs)
    ca_bundle = tmp / "upstream-ca.pem"
    ca_bundle.write_bytes(world.ca.cert_pem.bytes())
    config = {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
        "policy": str(policy_dir),
        "var_dir": str(tmp / "var"),
        "broker": {"local_key_dir": str(tmp / "var" / "keys")},
        "upstream": {"resolver": f"127.0.0.1:{world.dns_port}", "ca_bundle": str(ca_bundle)},
    }
    gateway = Gateway(**launch_loopback(tmp, config), policy_dir=policy_dir, world=world)
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


def proxy_of(gw: Gateway, sbx: Sandbox) -> str:
    return f"http://{sbx.id}:{sbx.token}@{gw.proxy[0]}:{gw.proxy[1]}"


def run(cmd: list[str], env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)


def pending(gw: Gateway, sbx: Sandbox, kind: str) -> list[dict]:
    listed = admin(gw, "GET", "/v1/approvals?state=pending").json()["approvals"]
    return [a for a in listed if a["sandbox_id"] == sbx.id and a["kind"] == kind]


def class_records(gw: Gateway, sbx: Sandbox, **match) -> list[dict]:
    time.sleep(0.2)  # records are written behind
    return records(gw, **{"egressgate.operation": "http_request", "egressgate.sandbox.id": sbx.id, **match})


def pip(gw: Gateway, sbx: Sandbox, pkgs: PkgServer, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        str(VENV_BIN / "python"),
        "-m",
        "pip",
        *args,
        "--isolated",
        "--disable-pip-version-check",  # --isolated ignores the PIP_* variables of client_env
        "--no-cache-dir",
        "--retries",
        "0",
        "--timeout",
        "30",
        "--proxy",
        proxy_of(gw, sbx),
        "--index-url",
        f"{pkgs.base}/simple/",
        "--trusted-host",
        pkgs.host,
        "tinywheel",
    ]
    return run(cmd, client_env(proxy_of(gw, sbx), tmp / "home"))


def _saw_index(pkgs: PkgServer, mark: int) -> list[tuple[str, str]]:
    return [h for h in pkgs.since(mark) if h[1].startswith(("/simple", "/files"))]


# --------------------------------------------------------------------------------------- PyPI (pip, uv)


def test_pip_download_and_install_are_refused_under_deny_and_work_under_allow(gw, pkgs, tmp_path):
    denied = gw.admit("pk-deny")
    mark = pkgs.mark()
    got = pip(gw, denied, pkgs, tmp_path / "d1", "download", "--dest", str(tmp_path / "d1" / "out"))
    assert got.returncode != 0 and not (tmp_path / "d1" / "out" / WHEEL_NAME).exists(), got.stdout + got.stderr
    installed = pip(gw, denied, pkgs, tmp_path / "i1", "install", "--target", str(tmp_path / "i1" / "site"))
    assert installed.returncode != 0 and not (tmp_path / "i1" / "site" / "tinywheel").exists()
    assert _saw_index(pkgs, mark) == []  # nothing reached the index, although a rule allows GET on it
    refused = class_records(gw, denied, **{"egressgate.reason": "package_install_denied"})
    assert refused and {r["egressgate.operation.class"] for r in refused} == {"package_install"}
    assert {r["egressgate.operation.protocol"] for r in refused} == {"pypi"}
    assert all("package_install: deny" in r["egressgate.message"] for r in refused)
    assert pending(gw, denied, "package_install") == []  # deny is final: no operator is asked

    allowed = gw.admit("pk-allow")  # positive control: the same client, server and rule
    got = pip(gw, allowed, pkgs, tmp_path / "d2", "download", "--dest", str(tmp_path / "d2" / "out"))
    assert got.returncode == 0, got.stdout + got.stderr
    assert (tmp_path / "d2" / "out" / WHEEL_NAME).read_bytes() == pkgs.wheel
    installed = pip(gw, allowed, pkgs, tmp_path / "i2", "install", "--target", str(tmp_path / "i2" / "site"))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert (tmp_path / "i2" / "site" / "tinywheel" / "__init__.py").read_text() == "VALUE = 42\n"
    assert ("GET", f"/files/{WHEEL_NAME}") in pkgs.since(mark)
    ok = class_records(gw, allowed, **{"egressgate.decision": "allow"})
    assert {r.get("egressgate.operation.class") for r in ok} == {"package_install"}  # named on allows too


def test_a_direct_wheel_url_from_any_host_is_a_package_install(gw, pkgs, tmp_path):
    denied, allowed = gw.admit("pk-deny"), gw.admit("pk-allow")
    url = f"{pkgs.base}/files/{WHEEL_NAME}"
    base = [
        str(VENV_BIN / "python"),
        "-m",
        "pip",
        "download",
        "--isolated",
        "--disable-pip-version-check",  # --isolated ignores the PIP_* variables of client_env
        "--no-cache-dir",
        "--retries",
        "0",
        "--no-deps",
        "--no-index",
        "--trusted-host",
        pkgs.host,
        "--dest",
    ]
    mark = pkgs.mark()
    got = run(
        [*base, str(tmp_path / "a"), "--proxy", proxy_of(gw, denied), url],
        client_env(proxy_of(gw, denied), tmp_path / "h1"),
    )
    assert got.returncode != 0 and not (tmp_path / "a" / WHEEL_NAME).exists()
    assert _saw_index(pkgs, mark) == []
    got = run(
        [*base, str(tmp_path / "b"), "--proxy", proxy_of(gw, allowed), url],
        client_env(proxy_of(gw, allowed), tmp_path / "h2"),
    )
    assert got.returncode == 0, got.stdout + got.stderr
    assert (tmp_path / "b" / WHEEL_NAME).exists()


def test_pip_install_waits_for_an_operator_under_approval(gw, pkgs, tmp_path):
    sbx = gw.admit("pk-approval")
    mark = pkgs.mark()
    first = pip(gw, sbx, pkgs, tmp_path / "1", "install", "--target", str(tmp_path / "1" / "site"))
    assert first.returncode != 0 and _saw_index(pkgs, mark) == []
    asked = pending(gw, sbx, "package_install")
    assert len(asked) == 1 and asked[0]["host"] == "pkgs.test", asked  # retries share one approval
    refused = class_records(gw, sbx, **{"egressgate.reason": "approval_required"})
    assert refused and {r["egressgate.detail"] for r in refused} == {"package_install"}
    assert {r["egressgate.approval.id"] for r in refused} == {asked[0]["id"]}
    assert approve(gw, asked[0]["id"], for_seconds=120, scope="host", by="ops").status_code == 200
    second = pip(gw, sbx, pkgs, tmp_path / "2", "install", "--target", str(tmp_path / "2" / "site"))
    assert second.returncode == 0, second.stdout + second.stderr
    assert (tmp_path / "2" / "site" / "tinywheel" / "__init__.py").exists()
    granted = class_records(gw, sbx, **{"egressgate.reason": "approval_granted"})
    assert granted and {r["egressgate.approval.id"] for r in granted} == {asked[0]["id"]}
    assert {r["egressgate.rule"] for r in granted} == {"pkgs-any"}  # the rule still decided where it goes
    other = gw.admit("pk-approval")  # the approval is this sandbox's only
    third = pip(gw, other, pkgs, tmp_path / "3", "install", "--target", str(tmp_path / "3" / "site"))
    assert third.returncode != 0 and len(pending(gw, other, "package_install")) == 1


def test_uv_pip_install_is_refused_under_deny_and_works_under_allow(gw, pkgs, tmp_path):
    uv = shutil.which("uv", path=str(VENV_BIN)) or shutil.which("uv")
    assert uv is not None, "uv is in the dev extra (pyproject.toml)"

    def uv_install(sbx: Sandbox, where: Path) -> subprocess.CompletedProcess:
        return run(
            [
                uv,
                "pip",
                "install",
                "--no-cache",
                "--python",
                sys.executable,
                "--target",
                str(where / "site"),
                "--index-url",
                f"{pkgs.base}/simple/",
                "--allow-insecure-host",
                pkgs.host,
                "tinywheel",
            ],
            client_env(proxy_of(gw, sbx), where / "home"),
        )

    mark = pkgs.mark()
    got = uv_install(gw.admit("pk-deny"), tmp_path / "a")
    assert got.returncode != 0 and _saw_index(pkgs, mark) == [], got.stderr
    got = uv_install(gw.admit("pk-allow"), tmp_path / "b")
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "b" / "site" / "tinywheel" / "__init__.py").exists()


# --------------------------------------------------------------------------------------- npm


def _npm_project(where: Path, pkgs: PkgServer, token: bool = False) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "package.json").write_text(json.dumps({"name": "consumer", "version": "1.0.0", "private": True}))
    home = where / "home"
    home.mkdir(exist_ok=True)
    npmrc = f"registry={pkgs.base}/\n"
    if token:
        npmrc += f"//{pkgs.host}:{pkgs.port}/:_authToken=test-token\n"
    (home / ".npmrc").write_text(npmrc)
    return home


def npm(gw: Gateway, sbx: Sandbox, where: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = client_env(proxy_of(gw, sbx), home)
    env["npm_config_proxy"] = proxy_of(gw, sbx)
    return run(["npm", *args], env, cwd=where)


def test_npm_install_is_refused_under_deny_and_works_under_allow(gw, pkgs, tmp_path):
    mark = pkgs.mark()
    home = _npm_project(tmp_path / "a", pkgs)
    denied = gw.admit("pk-deny")
    got = npm(gw, denied, tmp_path / "a", home, "install", "tinynpm@1.0.0", "--no-package-lock")
    assert got.returncode != 0 and not (tmp_path / "a" / "node_modules" / "tinynpm").exists()
    assert [h for h in pkgs.since(mark) if h[1].startswith("/tinynpm")] == []
    assert "403" in got.stdout + got.stderr  # npm shows the refusal, not a network error
    refused = class_records(gw, denied, **{"egressgate.reason": "package_install_denied"})
    assert {r["egressgate.operation.protocol"] for r in refused} == {"npm"}

    home = _npm_project(tmp_path / "b", pkgs)
    got = npm(gw, gw.admit("pk-allow"), tmp_path / "b", home, "install", "tinynpm@1.0.0", "--no-package-lock")
    assert got.returncode == 0, got.stdout + got.stderr
    assert json.loads((tmp_path / "b" / "node_modules" / "tinynpm" / "package.json").read_text())["version"] == "1.0.0"


def _npm_package(where: Path, name: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / "package.json").write_text(json.dumps({"name": name, "version": "0.0.1", "main": "index.js"}))
    (where / "index.js").write_text("module.exports = 1;\n")


def test_npm_publish_waits_for_approval_and_passes_after_it(gw, pkgs, tmp_path):
    sbx = gw.admit("pk-deny")  # installs denied, publish needs an operator
    home = _npm_project(tmp_path / "home-a", pkgs, token=True)
    _npm_package(tmp_path / "pkg-a", "egw-published-a")
    mark = pkgs.mark()
    got = npm(gw, sbx, tmp_path / "pkg-a", home, "publish")
    assert got.returncode != 0 and "egw-published-a" not in pkgs.published, got.stdout + got.stderr
    assert [h for h in pkgs.since(mark) if h[0] == "PUT"] == []
    asked = pending(gw, sbx, "publish")
    assert len(asked) == 1 and (asked[0]["method"], asked[0]["path"]) == ("PUT", "/egw-published-a"), asked
    refused = class_records(gw, sbx, **{"egressgate.reason": "approval_required"})
    assert {(r["egressgate.operation.class"], r["egressgate.operation.protocol"]) for r in refused} == {
        ("publish", "npm")
    }
    assert approve(gw, asked[0]["id"], scope="host+path", for_seconds=60, by="ops").status_code == 200
    got = npm(gw, sbx, tmp_path / "pkg-a", home, "publish")
    assert got.returncode == 0, got.stdout + got.stderr
    assert pkgs.published["egw-published-a"]["name"] == "egw-published-a"
    # one approval, one publish: the same package again (a new version) waits for a new approval
    (tmp_path / "pkg-a" / "package.json").write_text(
        json.dumps({"name": "egw-published-a", "version": "0.0.2", "main": "index.js"})
    )
    del pkgs.published["egw-published-a"]
    got = npm(gw, sbx, tmp_path / "pkg-a", home, "publish")
    assert got.returncode != 0 and "egw-published-a" not in pkgs.published, got.stdout + got.stderr
    assert [a["path"] for a in pending(gw, sbx, "publish")] == ["/egw-published-a"]
    # scope host+path: another package is another publish to approve
    _npm_package(tmp_path / "pkg-b", "egw-published-b")
    got = npm(gw, sbx, tmp_path / "pkg-b", home, "publish")
    assert got.returncode != 0 and "egw-published-b" not in pkgs.published

    control = gw.admit("pk-allow")  # positive control: no publish approval required
    _npm_package(tmp_path / "pkg-c", "egw-published-c")
    got = npm(gw, control, tmp_path / "pkg-c", _npm_project(tmp_path / "home-c", pkgs, token=True), "publish")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "egw-published-c" in pkgs.published


# --------------------------------------------------------------------------------------- git push


def _work_repo(where: Path, env: dict) -> None:
    subprocess.run(["git", "init", "-q", "-b", "main", str(where)], check=True, env=env)
    (where / "f.txt").write_text("hello\n")
    subprocess.run(["git", "-C", str(where), "add", "f.txt"], check=True, env=env)
    subprocess.run(["git", "-C", str(where), "commit", "-qm", "one"], check=True, env=env)


def git(gw: Gateway, sbx: Sandbox, env: dict, *args: str) -> subprocess.CompletedProcess:
    return run(["git", "-c", f"http.proxy={proxy_of(gw, sbx)}", *args], env)


def _head(bare: Path) -> str:
    got = subprocess.run(
        ["git", "-C", str(bare), "rev-parse", "--verify", "-q", "refs/heads/main"], capture_output=True, text=True
    )
    return got.stdout.strip()


def test_git_push_over_smart_http_waits_for_approval_and_clone_does_not(gw, pkgs, tmp_path):
    bare = pkgs.bare_repo("push-a.git")
    labels = {"team": "pub"}  # every approval record names them (approval_gate.py: the decision's state)
    sbx = gw.admit("pk-deny", labels=labels)
    env = client_env(proxy_of(gw, sbx), tmp_path / "home")
    _work_repo(tmp_path / "work", env)
    url = f"{pkgs.base}/git/push-a.git"
    mark = pkgs.mark()
    got = git(gw, sbx, env, "-C", str(tmp_path / "work"), "push", url, "main")
    assert got.returncode != 0 and _head(bare) == "", got.stderr
    assert [h for h in pkgs.since(mark) if "receive-pack" in h[1]] == []  # not even the discovery
    asked = pending(gw, sbx, "publish")
    assert len(asked) == 1, asked
    refused = class_records(gw, sbx, **{"egressgate.reason": "approval_required"})
    assert {r["egressgate.operation.protocol"] for r in refused} == {"git"}
    assert approve(gw, asked[0]["id"], scope="host", for_seconds=60, by="ops").status_code == 200
    got = git(gw, sbx, env, "-C", str(tmp_path / "work"), "push", url, "main")
    assert got.returncode == 0, got.stderr
    local = subprocess.run(
        ["git", "-C", str(tmp_path / "work"), "rev-parse", "HEAD"], capture_output=True, text=True, env=env
    ).stdout.strip()
    assert _head(bare) == local
    assert ("POST", "/git/push-a.git/git-receive-pack") in pkgs.since(mark)
    # the approval passed ONE push: its git-receive-pack spent it (audited `used`); the next push waits again
    match = {"egressgate.operation": "approval", "egressgate.approval.id": asked[0]["id"]}
    assert wait_for(lambda: len(records(gw, **match)) >= 3), records(gw, **match)
    steps = records(gw, **match)
    assert [(r["egressgate.approval.action"], labels_of(r)) for r in steps] == [
        ("requested", labels), ("approved", labels), ("used", labels)]
    (tmp_path / "work" / "f.txt").write_text("two\n")
    subprocess.run(["git", "-C", str(tmp_path / "work"), "commit", "-qam", "two"], check=True, env=env)
    pushed = _head(bare)
    got = git(gw, sbx, env, "-C", str(tmp_path / "work"), "push", url, "main")
    assert got.returncode != 0 and _head(bare) == pushed, got.stderr
    assert len(pending(gw, sbx, "publish")) == 1
    # a fetch is neither a publish nor a package install: it needs no approval, even under this policy
    other = gw.admit("pk-deny")
    got = git(
        gw, other, client_env(proxy_of(gw, other), tmp_path / "home2"), "clone", "-q", url, str(tmp_path / "clone")
    )
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "clone" / "f.txt").read_text() == "hello\n" and pending(gw, other, "publish") == []


def test_git_push_without_publish_approval_is_left_to_the_network_rules(gw, pkgs, tmp_path):
    bare = pkgs.bare_repo("push-b.git")
    sbx = gw.admit("pk-allow")
    env = client_env(proxy_of(gw, sbx), tmp_path / "home")
    _work_repo(tmp_path / "work", env)
    got = git(gw, sbx, env, "-C", str(tmp_path / "work"), "push", f"{pkgs.base}/git/push-b.git", "main")
    assert got.returncode == 0, got.stderr
    assert _head(bare) != ""


# --------------------------------------------------------------------------------------- twine upload


def test_twine_upload_waits_for_approval_and_passes_after_it(gw, pkgs, tmp_path):
    twine = shutil.which("twine", path=str(VENV_BIN))
    assert twine is not None, "twine is in the dev extra (pyproject.toml)"
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / WHEEL_NAME).write_bytes(pkgs.wheel)

    def upload(sbx: Sandbox, url: str) -> subprocess.CompletedProcess:
        env = client_env(proxy_of(gw, sbx), tmp_path / f"home-{sbx.id}")
        return run(
            [
                twine,
                "upload",
                "--non-interactive",
                "--disable-progress-bar",
                "--repository-url",
                url,
                "-u",
                "user",
                "-p",
                "pass",
                str(dist / WHEEL_NAME),
            ],
            env,
        )

    sbx = gw.admit("pk-approval")
    before = len(pkgs.uploads)
    got = upload(sbx, f"{pkgs.base}/legacy/")
    assert got.returncode != 0 and len(pkgs.uploads) == before, got.stdout + got.stderr
    asked = pending(gw, sbx, "publish")
    assert len(asked) == 1 and asked[0]["method"] == "POST", asked
    assert approve(gw, asked[0]["id"], scope="host", for_seconds=60, by="ops").status_code == 200
    got = upload(sbx, f"{pkgs.base}/legacy/")
    assert got.returncode == 0, got.stdout + got.stderr
    assert len(pkgs.uploads) == before + 1 and b'name=":action"' in pkgs.uploads[-1]
    # the upload form at an index root (pypiserver's URL) is the same protocol
    root = gw.admit("pk-approval")
    got = upload(root, f"{pkgs.base}/")
    assert got.returncode != 0 and len(pkgs.uploads) == before + 1
    assert len(pending(gw, root, "publish")) == 1
    control = gw.admit("pk-allow")  # positive control: publish not listed in require_approval_for
    got = upload(control, f"{pkgs.base}/")
    assert got.returncode == 0, got.stdout + got.stderr
    assert len(pkgs.uploads) == before + 2


# --------------------------------------------------------------------------------------- HTTPS (CONNECT)


def test_inside_an_intercepted_https_tunnel_each_request_is_classified(gw, pkgs_tls, tmp_path):
    """pip and git over HTTPS: the CONNECT to the package host is allowed (a tunnel carries no request
    yet), then every request inside it is classified and decided on its own."""

    def pip_tls(sbx: Sandbox, where: Path) -> subprocess.CompletedProcess:
        return run(
            [
                str(VENV_BIN / "python"),
                "-m",
                "pip",
                "install",
                "--isolated",
                "--disable-pip-version-check",
                "--no-cache-dir",
                "--retries",
                "0",
                "--timeout",
                "30",
                "--proxy",
                proxy_of(gw, sbx),
                "--cert",
                gw.bundle,
                "--index-url",
                f"{pkgs_tls.base}/simple/",
                "--target",
                str(where / "site"),
                "tinywheel",
            ],
            client_env(proxy_of(gw, sbx), where / "home"),
        )

    mark = pkgs_tls.mark()
    denied = gw.admit("pk-deny")
    got = pip_tls(denied, tmp_path / "a")
    assert got.returncode != 0 and _saw_index(pkgs_tls, mark) == [], got.stdout + got.stderr
    refused = class_records(gw, denied, **{"egressgate.reason": "package_install_denied"})
    assert refused and {r["url.scheme"] for r in refused} == {"https"}
    got = pip_tls(gw.admit("pk-allow"), tmp_path / "b")  # positive control
    assert got.returncode == 0, got.stdout + got.stderr
    assert (tmp_path / "b" / "site" / "tinywheel" / "__init__.py").exists()

    bare = pkgs_tls.bare_repo("tls.git")
    sbx = gw.admit("pk-approval")
    env = client_env(proxy_of(gw, sbx), tmp_path / "git-home")
    _work_repo(tmp_path / "work", env)
    push = [
        "-c",
        f"http.sslCAInfo={gw.bundle}",
        "-C",
        str(tmp_path / "work"),
        "push",
        f"{pkgs_tls.base}/git/tls.git",
        "main",
    ]
    got = git(gw, sbx, env, *push)
    assert got.returncode != 0 and _head(bare) == "", got.stderr
    asked = pending(gw, sbx, "publish")
    assert len(asked) == 1 and asked[0]["scheme"] == "https", asked
    assert approve(gw, asked[0]["id"], scope="host", for_seconds=60, by="ops").status_code == 200
    got = git(gw, sbx, env, *push)
    assert got.returncode == 0, got.stderr
    assert _head(bare) != ""


def test_a_method_override_header_does_not_turn_a_publish_into_a_post(gw, pkgs):
    sbx = gw.admit("pk-deny")
    mark = pkgs.mark()

    def post(extra: str) -> tuple[int, bytes]:
        body = b'{"name":"egw-override"}'
        with socket.create_connection(gw.proxy, timeout=30) as sock:
            sock.sendall(
                f"POST {pkgs.base}/egw-override HTTP/1.1\r\nHost: {pkgs.host}:{pkgs.port}\r\n{auth(sbx)}{extra}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            status, _headers, reply = read_reply(sock)
        return status, reply

    status, reply = post("X-HTTP-Method-Override: PUT\r\n")
    assert status == 403 and json.loads(reply)["reason"] == "approval_required", reply
    assert json.loads(reply)["approval_kind"] == "publish"
    assert pkgs.since(mark) == []
    status, _ = post("")  # control: a plain POST is not a publish; it reaches the server (which refuses it)
    assert status == 405 and pkgs.since(mark) == [("POST", "/egw-override")]
