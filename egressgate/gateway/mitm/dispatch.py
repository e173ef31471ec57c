"""Hook dispatch without the per-addon detour: mitmproxy's AddonManager, with a table of implementers.

Why: for every hook of every flow, mitmproxy 12.3.1's `AddonManager.trigger_event` walks the whole addon
chain and, for each addon, enters a `safecall()` context manager, creates an `invoke_addon` coroutine and
two generators (`_iter_hooks`, `traverse`), looks the hook up with `getattr` and rebuilds the hook's
argument list with `dataclasses.fields` — whether or not the addon implements the hook. `handle_lifecycle`
then does it all again for an `update` hook that no gateway addon implements. That is ~19 addons x 8
dispatches per plain HTTP request, measured at ~20 % of the gateway's CPU (loadtests/RESULTS.md, issue 11).

Here the implementers of each hook name are looked up once (same order, same traversal of sub-addons as
mitmproxy's `_iter_hooks`), and a dispatch calls only them. The semantics are mitmproxy's: an
`AddonHalt` stops the chain (the fail-closed wrappers rely on it, failclosed.py), an `OptionsError`
propagates, any other exception is logged as `safecall` logs it and the next addon runs. The table is
dropped whenever the chain changes (register/remove/clear); the gateway's addons set their hooks once,
at construction (failclosed.py), so a hook found (or not found) once stays so.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

from mitmproxy import addonmanager, exceptions, flow, hooks
from mitmproxy import master as mitm_master

logger = logging.getLogger("mitmproxy.addonmanager")  # the logger safecall() reports to

Implementers = tuple[Callable[..., Any], ...]


class HookTable(addonmanager.AddonManager):
    """An AddonManager whose async dispatch calls only the addons that implement the hook."""

    def __init__(self, master: mitm_master.Master) -> None:
        super().__init__(master)
        self._table: dict[str, Implementers] = {}

    def register(self, addon):
        self._table.clear()
        return super().register(addon)

    def remove(self, addon) -> None:
        self._table.clear()
        super().remove(addon)
        self._table.clear()

    def clear(self) -> None:
        super().clear()
        self._table.clear()

    def implementers(self, name: str) -> Implementers:
        """The hook callables for `name`, in chain order (mitmproxy's _iter_hooks over every addon)."""
        found = self._table.get(name)
        if found is None:
            funcs = []
            for addon in addonmanager.traverse(self.chain):
                func = getattr(addon, name, None)
                if not func or isinstance(func, types.ModuleType):
                    continue  # absent, or a module imported under a hook's name (mitmproxy skips those too)
                if not callable(func):
                    raise exceptions.AddonManagerError(f"Addon handler {name} ({addon}) not callable")
                funcs.append(func)
            found = self._table[name] = tuple(funcs)
        return found

    async def trigger_event(self, event: hooks.Hook) -> None:
        funcs = self.implementers(event.name)
        if not funcs:
            return
        args = event.args()
        for func in funcs:
            try:
                res = func(*args)
                if res is not None and inspect.isawaitable(res):
                    await res
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception as exc:  # as mitmproxy's safecall(): log and carry on with the next addon
                logger.error(f"Addon error: {exc}", exc_info=True)

    async def handle_lifecycle(self, event: hooks.Hook) -> None:
        await self.trigger_event(event)
        if self.implementers(hooks.UpdateHook.name):
            message = event.args()[0]
            if isinstance(message, flow.Flow):
                await self.trigger_event(hooks.UpdateHook([message]))


def install(master: mitm_master.Master) -> HookTable:
    """Give `master` a HookTable before any addon is added (the replaced manager has an empty chain)."""
    if master.addons.chain:
        raise RuntimeError("install the hook table before adding addons")
    master.options.changed.disconnect(master.addons._configure_all)
    master.addons = HookTable(master)
    return master.addons
