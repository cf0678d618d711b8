"""Background tasks that are kept and whose failures are seen.

asyncio holds only a weak reference to a task: one started and forgotten may be collected mid-flight, and its
exception is reported (if ever) as "Task exception was never retrieved" at some later garbage collection. A
TaskSet keeps each task until it ends and logs the exception a task ended with.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any


class TaskSet:
    def __init__(self, logger: logging.Logger, what: str):
        self._log = logger
        self._what = what  # for the log line, e.g. "event"
        self._tasks: set[asyncio.Task] = set()

    def start(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.error("%s task %s failed", self._what, task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
