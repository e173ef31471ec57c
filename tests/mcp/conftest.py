"""tests/mcp fixtures: `mem_world`, the mediator's world on a memory state store (mediator_world.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from egressgate.state.memory import MemoryState
from tests.mcp.mediator_world import World, make_world


@pytest.fixture
async def mem_world(tmp_path: Path) -> AsyncIterator[World]:
    w = await make_world(tmp_path, MemoryState())
    try:
        yield w
    finally:
        await w.rt.audit.close()
