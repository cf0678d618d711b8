"""The serve side of the sources client process: spawn it (as the model workers are spawned:
appliance/process_start.py), watch it, and replace it when it dies or stops answering.

Liveness: a Ping every second; no message at all for `timeout_s` (10 s) and the process is killed and replaced.
Restarts back off from 0.5 s, doubling up to 30 s; a process that ran for 60 s starts the next back-off at 0.5 s.
Meanwhile every source shows State Connecting with the reason as LastError (and SourceFault), counted in
appliance_source_process_restarts_total. Counters are kept across restarts (the new process counts from 0 again).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import subprocess
import time
from collections.abc import Callable

from appliance.process_start import reap, start_child

from . import protocol as p

log = logging.getLogger(__name__)
COUNTERS = ("samples", "windows", "reconnects")


class SourcesSupervisor:
    def __init__(self, specs: list[p.SourceSpec], *, on_window: Callable[[p.WindowReady], None],
                 on_status: Callable[[p.SourceStatus], None], log_level: str = "INFO", log_format: str = "text",
                 timeout_s: float = 10.0, backoff_s: float = 0.5, backoff_max_s: float = 30.0, metrics=None):
        self.specs = specs
        self.on_window = on_window
        self.on_status = on_status  # a source's status (counters across restarts), as it arrives
        self.log_level, self.log_format = log_level, log_format
        self.timeout_s, self.backoff_s, self.backoff_max_s = timeout_s, backoff_s, backoff_max_s
        self.metrics = metrics
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.statuses: dict[str, p.SourceStatus] = {
            s.name: p.SourceStatus(s.name, "Connecting" if s.enabled else "Disabled", "", 0, 0, {}, 0)
            for s in specs}
        self._base: dict[str, p.SourceStatus] = {}  # the counters of earlier processes
        self._channel: p.Channel | None = None
        self._heard_at = 0.0
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._seq = itertools.count(1)
        self._writes: dict[int, asyncio.Future] = {}  # Write id -> its answer

    async def start(self) -> None:
        if self.specs:
            self._task = asyncio.create_task(self._run(), name="sources-supervisor")

    async def stop(self) -> None:
        self._stopping = True
        self._kill()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        delay = self.backoff_s
        while not self._stopping:
            started = time.monotonic()
            try:
                reason = await self._life()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the supervision goes on whatever broke; logged with its trace
                log.exception("the sources client process could not be started or watched")
                reason = f"could not start ({type(e).__name__})"
            if self._stopping:
                return
            self.restarts += 1
            if self.metrics is not None:
                self.metrics.source_process_restarts.inc()
            if time.monotonic() - started > 60:
                delay = self.backoff_s
            message = f"the sources client process stopped ({reason}); restarting in {delay:.1f} s"
            log.error("%s", message)
            for name, st in list(self.statuses.items()):
                self._base[name] = st
                if st.state != "Disabled":
                    self._publish(p.SourceStatus(name, "Connecting", message, 0, 0, {}, 0), merged=False)
            await asyncio.sleep(delay)
            delay = min(self.backoff_max_s, delay * 2)

    async def _life(self) -> str:
        self.process, parent = start_child("appliance.sources.process")
        ended = asyncio.get_running_loop().create_future()
        channel = await p.Channel.open(parent, p.FromSources)
        self._channel = channel
        channel.listen(self._on_message, lambda reason: ended.done() or ended.set_result(reason))
        channel.send(p.Start(sources=self.specs, log_level=self.log_level, log_format=self.log_format))
        self._heard_at = time.monotonic()
        log.info("sources client process started (pid %d, %d sources)", self.process.pid, len(self.specs))
        reason = ""
        while not ended.done():
            if time.monotonic() - self._heard_at > self.timeout_s:
                reason = f"it did not answer for {self.timeout_s:g} s"
                self._kill()
                break
            try:
                channel.send(p.Ping(seq=next(self._seq)))
            except ConnectionError:
                break
            await asyncio.wait({ended}, timeout=1.0)
        code = await asyncio.to_thread(reap, self.process)
        if not reason:
            reason = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
                      else f"exit status {code}")
        return reason

    async def write(self, source: str, nodes: list[int], types: list[str], values: list,
                    timeout_s: float = 10.0) -> list[str]:
        """Results into a source's write-back NodeIds (see protocol.Write): each write's status name."""
        channel = self._channel
        if channel is None or channel.closed_reason:
            return ["BadNotConnected"] * len(nodes)
        request = p.Write(id=next(self._seq), source=source, nodes=nodes, types=types, values=values)
        future = asyncio.get_running_loop().create_future()
        self._writes[request.id] = future
        try:
            channel.send(request)
            return await asyncio.wait_for(future, timeout_s)
        except (ConnectionError, asyncio.TimeoutError):
            return ["BadTimeout"] * len(nodes)
        finally:
            self._writes.pop(request.id, None)

    def _on_message(self, message) -> None:
        self._heard_at = time.monotonic()
        if isinstance(message, p.WindowReady):
            self.on_window(message)
        elif isinstance(message, p.Written):
            future = self._writes.get(message.id)
            if future is not None and not future.done():
                future.set_result(message.statuses)
        elif isinstance(message, p.SourceStatus):
            self._publish(message)

    def _publish(self, st: p.SourceStatus, merged: bool = True) -> None:
        base = self._base.get(st.source)
        if merged and base is not None:
            skipped = dict(base.skipped)
            for reason, n in st.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
            st = p.SourceStatus(st.source, st.state, st.error, base.samples + st.samples, base.windows + st.windows,
                                skipped, base.reconnects + st.reconnects)
        elif not merged and base is not None:
            st = p.SourceStatus(st.source, st.state, st.error, base.samples, base.windows, dict(base.skipped),
                                base.reconnects)
        self.statuses[st.source] = st
        self.on_status(st)

    def _kill(self) -> None:
        proc = self.process
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._channel is not None:
            self._channel.close()
