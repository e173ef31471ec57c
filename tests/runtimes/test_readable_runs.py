"""Refusals an agent reads inside a real `egressgate sandbox run --runtime netns` (issue 21 item 4).

Transparent (no proxy settings at all): the denied name resolves to the gateway (the host end of the run's
link; the world's resolver, the DNS canary, never hears it), the connection is redirected to the
transparent listener, and curl and Python's urllib print the JSON deny over the gateway's TLS. Explicit
proxy (the environment admission hands out): the refused CONNECT is accepted and answered inside, so the
same JSON is printed. Positive controls: the allowed host through both paths; the upstream canary for the
denied name stays silent.
"""

from __future__ import annotations

import json

from tests.runtimes.harness import Gateway

NO_PROXY = ("env", "-u", "HTTP_PROXY", "-u", "HTTPS_PROXY", "-u", "http_proxy", "-u", "https_proxy", "NO_PROXY=*")
CURL = ("curl", "-sS", "--max-time", "15")
URLLIB = (
    "import json, sys, urllib.request, urllib.error\n"
    "try:\n"
    "    r = urllib.request.urlopen(sys.argv[1], timeout=15); print(json.dumps({'status': r.status}))\n"
    "except urllib.error.HTTPError as e:\n"
    "    print(json.dumps({'status': e.code, 'body': e.read().decode()}))\n"
)


def _denied(stdout: str) -> dict:
    body = json.loads(stdout.strip().splitlines()[-1])
    assert body["error"] == "egress_denied" and body["reason"] == "host_not_allowed" and body["request_id"], body
    return body


def test_transparent_run_prints_the_deny_and_the_name_never_leaves(gateway: Gateway) -> None:
    world = gateway.world
    mark = world.mark()
    res = gateway.run(*NO_PROXY, *CURL, "--noproxy", "*", "https://forbidden.test/run", policy="rt-allow")
    assert res.returncode == 0, res.stdout + res.stderr
    body = _denied(res.stdout)
    py = gateway.run(*NO_PROXY, "/usr/bin/python3", "-c", URLLIB, "https://forbidden.test/py", policy="rt-allow")
    out = json.loads(py.stdout.strip().splitlines()[-1])
    assert out["status"] == 403 and _denied(out["body"]), py.stdout + py.stderr
    assert [q for q in world.dns_queries(mark) if q["qname"] == "forbidden.test"] == []  # the DNS canary
    assert world.hits(mark, listener="forbidden-tls") == []
    record = gateway.records(predicate=lambda r: r.get("egressgate.request.id") == body["request_id"])
    [decision] = [r for r in record if r.get("egressgate.request.id") == body["request_id"]]
    assert decision["egressgate.mode"] == "transparent" and decision["egressgate.decision"] == "deny"
    asked = [
        r
        for r in gateway.records(predicate=lambda r: r.get("dns.question.name") == "forbidden.test")
        if r.get("dns.question.name") == "forbidden.test"
    ]
    assert any(r.get("egressgate.dns.answer") == "gateway" for r in asked), asked
    # positive control: the allowed name through the same path reaches the upstream
    ok = gateway.run(
        *NO_PROXY,
        *CURL,
        "--noproxy",
        "*",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "https://api.allowed.test/",
        policy="rt-allow",
    )
    assert ok.stdout == "200", ok.stdout + ok.stderr
    assert "upstream-tls" in {h.get("listener") for h in world.hits(mark)}


def test_explicit_proxy_run_prints_the_deny_of_a_refused_connect(gateway: Gateway) -> None:
    world = gateway.world
    mark = world.mark()
    res = gateway.run(*CURL, "https://forbidden.test/proxied", policy="rt-allow")
    assert res.returncode == 0, res.stdout + res.stderr
    _denied(res.stdout)
    py = gateway.run("/usr/bin/python3", "-c", URLLIB, "https://forbidden.test/py-proxied", policy="rt-allow")
    out = json.loads(py.stdout.strip().splitlines()[-1])
    assert out["status"] == 403 and _denied(out["body"]), py.stdout + py.stderr
    assert world.hits(mark, listener="forbidden-tls") == []
    ok = gateway.run(*CURL, "-o", "/dev/null", "-w", "%{http_code}", "https://api.allowed.test/", policy="rt-allow")
    assert ok.stdout == "200", ok.stdout + ok.stderr
