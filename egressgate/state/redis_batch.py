"""Automatic pipelining: the Redis commands issued in one event-loop tick go out as one pipeline.

Why: a gateway under load has dozens of requests in flight, each needing a few state operations.
Sent one by one, each pays a write syscall, a wakeup and a read (~100 us of CPU in this process, about
a third of a request's budget at c=32, measured); sent together, those costs are paid once per batch.
Each command is still a single atomic command (an EVALSHA or a plain one): batching changes when bytes
go out, not what Redis executes, and every caller gets exactly its own reply or error.

A script Redis does not know (after a Redis restart or a SCRIPT FLUSH) answers NOSCRIPT without
running; those commands are sent again once after loading the scripts, so nothing runs twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

MAX_BATCH = 512  # commands per pipeline


class Batcher:
    def __init__(self, redis: Redis, scripts: Sequence[str]) -> None:
        self.redis = redis
        self.scripts = list(scripts)  # Lua sources, loaded again after NOSCRIPT
        self._queue: list[tuple[tuple[Any, ...], asyncio.Future]] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task] = set()

    def call(self, *command: Any) -> asyncio.Future:
        """Queue one command; its future gets the reply or the exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((command, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._scheduled = False
        queue, self._queue = self._queue, []
        loop = asyncio.get_running_loop()
        for start in range(0, len(queue), MAX_BATCH):
            task = loop.create_task(self._send(queue[start:start + MAX_BATCH]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[tuple[Any, ...], asyncio.Future]]) -> None:
        try:
            results = await self._execute([command for command, _ in batch])
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:  # not run: load the scripts, send exactly those again
                await self._load_scripts()
                again = await self._execute([batch[i][0] for i in missing])
                for i, result in zip(missing, again, strict=True):
                    results[i] = result
        except Exception as exc:  # every waiter learns the batch failed (a connection error, a timeout)
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # cancelled (close()): so are the waiters
            for _, future in batch:
                future.cancel()
            raise
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():  # the caller was cancelled; the command ran anyway (as it would have)
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        if len(commands) == 1:  # nothing to batch with (light load): a plain command is cheaper
            try:
                return [await self.redis.execute_command(*commands[0])]
            except NoScriptError as exc:
                return [exc]
            except ResponseError as exc:  # that command's own error, as a pipeline would report it
                return [exc]
        async with self.redis.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute(raise_on_error=False)

    async def _load_scripts(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for source in self.scripts:
                pipe.script_load(source)
            await pipe.execute()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
