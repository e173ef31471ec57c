"""Fail closed when an egressgate addon raises.

mitmproxy catches exceptions from addon hooks, logs them and carries on with the next addon and then the
flow: a bug in a check would let the request through unchecked. Every egressgate addon is therefore
wrapped: an exception in a flow hook refuses what that hook was guarding (a deny response before anything
went upstream, a killed flow after, an error on a server connection, an aborted client connection for
TLS and layer decisions) and halts the hook chain so no later addon can treat the flow as decided.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import exceptions, http, tcp
from mitmproxy.proxy import server_hooks

from egressgate.gateway.shared.compose import buffer_body
from egressgate.gateway.shared.context import ensure_flow_state
from egressgate.gateway.shared.deny import deny_response, gateway_deny
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)

# Hooks that run before anything of the request went upstream: a deny response can still be sent.
_BEFORE_UPSTREAM = frozenset({"http_connect", "requestheaders", "request"})
# Hooks whose failure needs no enforcement (bookkeeping after the fact).
_AFTER_THE_FACT = frozenset({"error", "tcp_end", "tcp_error", "client_disconnected", "server_disconnected",
                             "server_connect_error", "websocket_end", "websocket_error"})
# Lifecycle hooks are not guarded: an exception there must surface at startup, not be swallowed.
_LIFECYCLE = frozenset({"load", "configure", "running", "done", "update", "add_log"})

Abort = Callable[[str], object]  # abort a client connection by id
# Records a refused HTTP flow (record.Record.refused): (flow, hook). A refusal is a decision like
# any other; without its record the request id in the 500 body would lead an auditor nowhere.
Refused = Callable[[http.HTTPFlow, str], object]


class FailClosed:
    """A wrapper around one addon; mitmproxy sees the same hooks.

    The guarded hooks are built once here and stored as plain attributes: mitmproxy looks every hook up
    on every addon for every event, so a `__getattr__` (or a closure per lookup) would be paid millions
    of times under load."""

    def __init__(self, addon: Any, abort: Abort, refused: Refused | None = None) -> None:
        self._addon = addon
        self._abort = abort
        self._refused = refused
        self.name = getattr(addon, "name", type(addon).__name__.lower())  # mitmproxy looks addons up by name
        for attr_name in dir(type(addon)):
            if attr_name.startswith("_") or attr_name == "name":
                continue
            attr = getattr(addon, attr_name)
            if not callable(attr) or inspect.isclass(attr):
                continue
            setattr(self, attr_name, attr if attr_name in _LIFECYCLE else self._guard(attr_name, attr))

    def _guard(self, name: str, attr: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(attr):

            async def guarded_async(*args: Any) -> Any:
                try:
                    return await attr(*args)
                except exceptions.AddonHalt:
                    raise
                except Exception:
                    self._fail(name, args)
                    raise exceptions.AddonHalt() from None

            return guarded_async

        def guarded(*args: Any) -> Any:
            try:
                return attr(*args)
            except exceptions.AddonHalt:
                raise
            except Exception:
                self._fail(name, args)
                raise exceptions.AddonHalt() from None

        return guarded

    def _fail(self, hook: str, args: tuple) -> None:
        logger.exception("addon %s failed in %s; refusing the flow (fail closed)", type(self._addon).__name__, hook)
        if hook in _AFTER_THE_FACT or not args:
            return
        subject = args[0]
        try:
            refuse(hook, subject, self._abort, self._refused)
        except Exception:  # the refusal itself must not fail open either: cut the client
            logger.exception("refusal after %s failed; aborting the client connection", hook)
            client = _client_id(subject)
            if client is not None:
                self._abort(client)


def refuse(hook: str, subject: Any, abort: Abort, refused: Refused | None = None) -> None:
    carried = getattr(subject, "flow", None)
    if isinstance(carried, http.HTTPFlow) and not isinstance(subject, http.HTTPFlow | tcp.TCPFlow):
        subject = carried  # hook data carrying its flow (ws_layer's websocket_wire / websocket_control)
    if isinstance(subject, http.HTTPFlow):
        # a streamed body is already upstream by the `request` hook: cutting the flow is the only safe
        # refusal; before it, the answer goes out before any body is read (early_answer.py)
        request = subject.request
        cannot_answer = hook == "request" and bool(request.stream)
        if hook in _BEFORE_UPSTREAM and subject.response is None and subject.live and not cannot_answer:
            # the flow's one request id (assigned once, in context.py), never mitmproxy's flow id
            fs = ensure_flow_state(subject)
            subject.response = deny_response(gateway_deny(Reason.INTERNAL_ERROR), fs.request_id)
            buffer_body(subject.request)
        elif subject.killable:
            subject.kill()
        if refused is not None:
            refused(subject, hook)
        return
    if isinstance(subject, tcp.TCPFlow):
        if subject.killable:
            subject.kill()
        return
    if isinstance(subject, server_hooks.ServerConnectionHookData):
        subject.server.error = "egressgate: internal error while checking this connection"
        if subject.client is not None:
            abort(subject.client.id)
        return
    client = _client_id(subject)
    if client is not None:
        abort(client)


def _client_id(subject: Any) -> str | None:
    context = getattr(subject, "context", None)
    client = (getattr(context, "client", None) or getattr(subject, "client_conn", None)
              or getattr(subject, "client", None))
    return getattr(client, "id", None)
