"""An answer from a thread to a coroutine waiting on the event loop.

The engine thread and the load thread never touch asyncio objects directly: they settle the waiting future through
`loop.call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Reply:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    # Generate: called on the loop with (text so far, tokens so far) after each step that added to the reply
    progress: Callable[[str, int], None] | None = None

    def send_progress(self, text: str, tokens: int) -> None:
        if self.progress is not None:
            try:
                self.loop.call_soon_threadsafe(self.progress, text, tokens)
            except RuntimeError:
                pass

    def send(self, value: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(value)
        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass
