"""A real `mcp` SDK stdio server for the local MCP tests (`egressgate mcp run ... -- python THIS --record F`).

It records, one JSON line per event in the file given by --record (in the sandbox's workspace, where the
test reads it): `{"event": "started"}` when the process starts (before the SDK is even imported, so a
test can prove a refused start never ran it) and `{"event": "call", "tool": ..., "arguments": ...}` for
every tool call the SDK dispatched. A denied call must never appear here: that is the "the server never
saw it" half of every adversarial test. `--tag` is only there to find this process in /proc; `--linger`
keeps it alive after its stdin ends (so only a kill can end it).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.request

parser = argparse.ArgumentParser()
parser.add_argument("--record", required=True)
parser.add_argument("--tag", default="")
parser.add_argument("--name", default="local-tools")
parser.add_argument("--version", default="1.0.0")
parser.add_argument("--linger", action="store_true", help="stay alive after stdin ends (a server that must be killed)")
args = parser.parse_args()


def record(event: dict) -> None:
    with open(args.record, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(event) + "\n")


record({"event": "started", "pid": os.getpid()})

from mcp.server.mcpserver import MCPServer  # noqa: E402 - after the start record (see the docstring)

server = MCPServer(args.name, version=args.version)


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    record({"event": "call", "tool": "echo", "arguments": {"text": text}})
    return text


@server.tool()
def delete_everything(confirm: bool = True) -> str:
    """A tool no policy should allow."""
    record({"event": "call", "tool": "delete_everything", "arguments": {"confirm": confirm}})
    return "deleted"


@server.tool()
def lookup(project: str) -> str:
    """Read a project's tickets (a tenant identifier: the policy ties it to the sandbox's label)."""
    record({"event": "call", "tool": "lookup", "arguments": {"project": project}})
    return f"tickets of {project}"


@server.tool()
def fetch(url: str) -> str:
    """GET the url from inside the sandbox (through the gateway: the only way out) and say what happened."""
    record({"event": "call", "tool": "fetch", "arguments": {"url": url}})
    context = ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE"))
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as resp:  # noqa: S310 - test tool
            return f"status {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"status {exc.code}"
    except Exception as exc:  # the tool's answer says how it failed
        return f"failed {type(exc).__name__}"


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    server.run("stdio")
    if args.linger:  # what a careless or hostile server does: ignore the end of its input
        record({"event": "lingering"})
        import time

        time.sleep(600)
