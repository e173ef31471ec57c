"""Run one real HTTP client the way an agent would, print what the agent gets to read (JSON on stdout).

Usage: python readable_clients.py CLIENT URL CA [PROXY]
CLIENT: requests | httpx | urllib. With PROXY the client goes through the explicit proxy (as with the
sandbox's HTTPS_PROXY); without it, it connects directly (a transparent sandbox: name resolution by the
system resolver, the connection redirected to the gateway). CA is the bundle the client trusts.

The output is {"status", "body", "headers"} for a response, or {"error": str(exception)} when the client
raised: exactly the text an agent sees in its program's output or traceback.
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
    args = sys.argv[1:]
    print(json.dumps(run(args[0], args[1], args[2], args[3] if len(args) > 3 else None)))
