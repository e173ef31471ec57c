"""Run one real HTTP client the way an agent would, print what the agent gets to read (JSON on stdout).

Usage: python readable_clients.py CLIENT CA PROXY URL [URL ...]
CLIENT: requests | httpx | urllib. With a PROXY the client goes through the explicit proxy (as with the
sandbox's HTTPS_PROXY); with `-` it connects directly (a transparent sandbox: name resolution by the
system resolver, the connection redirected to the gateway). CA is the bundle the client trusts.

Each URL is fetched in turn by a client of its own (nothing pooled or shared between them: a new
`requests.get`, `httpx.Client` or opener each), so a refusal and its positive control run in one
interpreter: the test suite pays one Python start and one client import for both.

The output is a JSON list, one entry per URL: {"status", "body", "headers"} for a response, or
{"error": str(exception)} when the client raised: exactly the text an agent sees in its program's output
or traceback.
"""

from __future__ import annotations

import json
import ssl
import sys


def run(client: str, url: str, ca: str, proxy: str | None) -> dict:
    if client == "requests":
        import requests

        try:
            r = requests.get(url, proxies={"https": proxy, "http": proxy} if proxy else None, verify=ca, timeout=20)
        except requests.RequestException as exc:
            return {"error": repr(exc)}
        return {"status": r.status_code, "body": r.text, "headers": dict(r.headers)}
    if client == "httpx":
        import httpx

        try:
            with httpx.Client(proxy=proxy, verify=ca, timeout=20, trust_env=False) as c:
                r = c.get(url)
        except httpx.HTTPError as exc:
            return {"error": repr(exc)}
        return {"status": r.status_code, "body": r.text, "headers": dict(r.headers)}
    if client == "urllib":
        import urllib.error
        import urllib.request

        handlers: list = [urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca))]
        handlers.append(urllib.request.ProxyHandler({"https": proxy, "http": proxy} if proxy else {}))
        opener = urllib.request.build_opener(*handlers)
        try:
            with opener.open(url, timeout=20) as r:
                return {"status": r.status, "body": r.read().decode(), "headers": dict(r.headers)}
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, "body": exc.read().decode(), "headers": dict(exc.headers)}
        except (urllib.error.URLError, OSError) as exc:
            return {"error": repr(exc)}
    raise SystemExit(f"unknown client {client}")


if __name__ == "__main__":
    client, ca, proxy, *urls = sys.argv[1:]
    if not urls:
        raise SystemExit(__doc__)
    print(json.dumps([run(client, url, ca, None if proxy == "-" else proxy) for url in urls]))
