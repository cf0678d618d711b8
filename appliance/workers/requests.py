"""The calls serve makes of one worker: each request gets an id and a future that its answer resolves, within its
deadline (then the worker is told to Cancel it); a generative call's partial text goes to its listener as it comes.
The supervisor (appliance/workers/supervisor.py) hands this the connection of the worker that is up, passes on
every answer it decodes, and fails what is in flight when the worker goes down."""
from __future__ import annotations

import asyncio
import itertools
from typing import Callable

from core.errors import DeadlineExceeded, NotReady, error_from
from appliance.workers import protocol as p


class WorkerRequests:
    def __init__(self):
        self.channel: p.Channel | None = None  # the connection of the worker that is up; None while none is
        self._pending: dict[int, asyncio.Future] = {}
        self._progress: dict[int, Callable[[str, int], None]] = {}  # request id -> partial-text listener
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    async def call(self, message, deadline: float | None, on_progress=None):
        """Send a request (its `id` is set here) and wait for its answer until `deadline` (monotonic; None: no
        limit); engine failures are raised as core.errors exceptions."""
        if self.channel is None:
            raise NotReady("the model's worker is restarting")
        message.id = self.next_id()
        if on_progress is not None:
            self._progress[message.id] = on_progress
        try:
            reply = await self.request(message, deadline)
        finally:
            self._progress.pop(message.id, None)
        if isinstance(reply, p.Failed):
            raise error_from(reply.reason, reply.message, reply.index, reply.kind)
        return reply

    async def request(self, message, deadline: float | None = None):
        """The worker's answer to `message` (whose id is set), a Failed one included."""
        future = asyncio.get_running_loop().create_future()
        self._pending[message.id] = future
        try:
            if self.channel is None:
                raise ConnectionError
            self.channel.send(message)
        except ConnectionError:
            self._pending.pop(message.id, None)
            raise NotReady("the model's worker is restarting") from None
        timer = None
        if deadline is not None:  # a timer rather than wait_for: one loop turn less per call
            timer = asyncio.get_running_loop().call_at(deadline, _expire, future)
        try:
            return await future
        except TimeoutError:
            self._cancel(message.id)
            raise DeadlineExceeded("the request's deadline passed") from None
        except asyncio.CancelledError:
            self._cancel(message.id)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(message.id, None)

    def on_answer(self, message) -> None:
        """A message of the worker about a request: partial text (GenerateProgress) or its answer."""
        if isinstance(message, p.GenerateProgress):
            listener = self._progress.get(message.id)
            if listener is not None:
                listener(message.text, message.token_count)
            return
        future = self._pending.pop(message.id, None)
        if future is not None and not future.done():
            future.set_result(message)

    def send(self, message) -> None:
        """A message without an answer (Release); dropped when no worker is up (it holds nothing then)."""
        if self.channel is not None:
            try:
                self.channel.send(message)
            except ConnectionError:
                pass

    def fail_pending(self, error: Exception) -> None:
        """Every call waiting for the worker's answer ends with `error` (shutdown, or the worker died)."""
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    def _cancel(self, request_id: int) -> None:
        if self._pending.pop(request_id, None) is not None:
            self.send(p.Cancel(id=request_id))


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
