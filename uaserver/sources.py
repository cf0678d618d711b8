"""What the sources show in the address space, and where a watched window's result goes.

`Appliance/Sources/<name>` (SourceType): State (Connected | Connecting | BadData | Refused | Disabled), Endpoint,
SamplesReceived, WindowsRun, WindowsSkipped (every reason), WindowsDropped (the model was busy), Reconnects,
LastError. `Alarms/SourceFault/<name>` is true while the source is neither Connected nor Disabled; it is also a Part 9
condition (`SourceFault.<name>`, source the Sources object) that SCADA acknowledges like the others (alarms.py).

A window from a feed runs as an Infer call does (inference.py): the same routing (variant, fallback, Ready), the same
model service and worker, then, for a labelled model, the same Last / Last/<feed> and class alarms with the feed's
name as source (Alarms.classified), and the same drift update. So a watched window's result is what Infer answers
for the same window. At most `max_in_flight` windows of a feed are in the model at once and one waits; a newer window
takes the waiting one's place (that one is dropped and counted): the latest always runs, nothing queues.
"""
from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
from asyncua import Server, ua

from core.errors import ApplianceError

from .address_space import AddressSpaceBuilder, ApplianceNodes, write
from .alarms import Alarms
from .governance import Governance
from .methods import CallContext
from core.object_types import FOLDER
from .type_builder import retype

log = logging.getLogger(__name__)
V = ua.VariantType
FAULT_STATES = ("Connecting", "BadData", "Refused")
STATE_CODES = {"Connected": 0, "Connecting": 1, "BadData": 2, "Refused": 3, "Disabled": 4}


class SourceObjects:
    def __init__(self, config, services: dict, governance: Governance, alarms: Alarms, request_timeout_s: float,
                 metrics=None):
        self.config = config
        self.services = services
        self.governance = governance
        self.alarms = alarms
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.server: Server | None = None
        self.values: dict[str, dict[str, object]] = {}  # source -> variable name -> node
        self.feeds = {f.name: (src.name, f) for src in config.sources.values() for f in src.feeds.values()}
        self.write_targets: dict[str, list[str]] = {}  # source -> its write-back NodeIds, as specs.py orders them
        for src in config.sources.values():
            targets = self.write_targets[src.name] = []
            for f in src.feeds.values():
                targets += [n for n in f.write_back.values() if n not in targets]
        self.in_flight: dict[str, int] = {name: 0 for name in self.feeds}
        self.waiting: dict[str, object] = {}  # feed -> the window waiting for the model (the latest one)
        self.run: dict[str, int] = {}  # source -> windows run
        self.dropped: dict[str, int] = {}  # source -> windows dropped (model busy)
        self.latest: dict[str, object] = {}  # source -> its latest protocol.SourceStatus
        self._counted: dict[tuple, float] = {}  # what the metrics have counted of the cumulative counters
        self._tasks: set[asyncio.Task] = set()
        self._writing: set[str] = set()
        # write_back: set by the daemon once the sources client process runs: async (source, nodes, types, values)
        # -> statuses; audit_event: the method handlers' audit of non-call events
        self.writer = None
        self.audit_event = None

    # ---- the address space ----

    async def build(self, server: Server, ns: int, nodes: ApplianceNodes) -> None:
        """Sources/<name> and the Alarms/SourceFault/<name> Booleans (before the alarms build their conditions)."""
        if not self.config.sources:
            return
        self.server = server
        b = AddressSpaceBuilder(server, ns)
        folder = await nodes.root.add_object(b.nid("Appliance/Sources"), ua.QualifiedName("Sources", ns))
        await retype(folder, ua.NodeId(ua.ObjectIds.FolderType))
        nodes.type_of[folder.nodeid] = FOLDER
        alarms_obj = server.get_node(b.nid("Appliance/Alarms"))
        faults = await alarms_obj.add_object(b.nid("Appliance/Alarms/SourceFault"),
                                             ua.QualifiedName("SourceFault", ns))
        await retype(faults, ua.NodeId(ua.ObjectIds.FolderType))
        for name, src in self.config.sources.items():
            path = f"Appliance/Sources/{name}"
            obj = await folder.add_object(b.nid(path), ua.QualifiedName(name, ns))
            await retype(obj, nodes.types["SourceType"])
            nodes.type_of[obj.nodeid] = "SourceType"
            own = self.values[name] = {}
            for key, value, vtype in (("State", "Connecting" if src.enabled else "Disabled", V.String),
                                      ("Endpoint", src.endpoint, V.String), ("SamplesReceived", 0, V.UInt64),
                                      ("WindowsRun", 0, V.UInt64), ("WindowsSkipped", 0, V.UInt64),
                                      ("WindowsDropped", 0, V.UInt64), ("Reconnects", 0, V.UInt32),
                                      ("LastError", "", V.String)):
                own[key] = await b.variable(obj, path, key, value, vtype)
            nodes.alarms[f"SourceFault/{name}"] = await b.variable(faults, "Appliance/Alarms/SourceFault", name,
                                                                   False, V.Boolean)

    # ---- a source's status (from the sources client process) ----

    def status(self, st) -> None:
        """protocol.SourceStatus, on serve's loop: shown at once (a write task per source at a time)."""
        self.latest[st.source] = st
        self._metrics_of(st)
        if self.server is None or st.source in self._writing:
            return
        self._writing.add(st.source)
        self._start(self._write_status(st.source))

    async def _write_status(self, source: str) -> None:
        try:
            while True:
                st = self.latest[source]
                v = self.values[source]
                await write(self.server, v["State"], st.state, V.String)
                await write(self.server, v["LastError"], st.error, V.String)
                await write(self.server, v["SamplesReceived"], int(st.samples), V.UInt64)
                await write(self.server, v["WindowsSkipped"], int(sum(st.skipped.values())), V.UInt64)
                await write(self.server, v["Reconnects"], int(st.reconnects) % 2**32, V.UInt32)
                await write(self.server, v["WindowsRun"], self.run.get(source, 0), V.UInt64)
                await write(self.server, v["WindowsDropped"], self.dropped.get(source, 0), V.UInt64)
                faulty = st.state in FAULT_STATES
                await self.alarms.set_alarm(f"SourceFault/{source}", faulty,
                                            f"Source {source}: {st.state}" + (f": {st.error}" if st.error else ""))
                if self.metrics is not None:
                    self.metrics.alarm_active.labels(f"SourceFault/{source}").set(1 if faulty else 0)
                if self.latest[source] is st:
                    return
        finally:
            self._writing.discard(source)

    def _metrics_of(self, st) -> None:
        m = self.metrics
        if m is None:
            return
        m.source_state.labels(st.source).set(STATE_CODES.get(st.state, 1))
        for key, value, counter in (((st.source, "samples"), st.samples, m.source_samples.labels(st.source)),
                                    ((st.source, "reconnects"), st.reconnects,
                                     m.source_reconnects.labels(st.source))):
            self._count(key, value, counter)
        for reason, n in st.skipped.items():
            self._count((st.source, "skipped", reason), n, m.source_windows_skipped.labels(st.source, reason))

    def _count(self, key: tuple, value: float, counter) -> None:
        before = self._counted.get(key, 0)
        if value > before:
            counter.inc(value - before)
        self._counted[key] = max(before, value)

    # ---- windows ----

    def window(self, msg) -> None:
        """protocol.WindowReady, on serve's loop. A feed has at most `max_in_flight` windows in the model and one
        waiting: a newer window takes the waiting one's place (that one is dropped and counted), so the latest
        window always runs and nothing queues without bound."""
        entry = self.feeds.get(msg.feed)
        if entry is None:
            return
        source, feed = entry
        if self.in_flight[msg.feed] >= feed.max_in_flight:
            if msg.feed in self.waiting:
                self._dropped(source, msg.feed)
            self.waiting[msg.feed] = msg
            return
        self._launch(source, feed, msg)

    def _launch(self, source: str, feed, msg) -> None:
        self.in_flight[feed.name] += 1
        samples = np.frombuffer(msg.data, dtype=np.float32)
        self._start(self._run_window(source, feed, samples, msg.last_source_time))

    def _dropped(self, source: str, feed: str) -> None:
        self.dropped[source] = self.dropped.get(source, 0) + 1
        if self.metrics is not None:
            self.metrics.source_windows.labels(feed, "dropped").inc()

    async def _run_window(self, source: str, feed, samples: np.ndarray, last_source_time: float) -> None:
        outcome = "run"
        try:
            r, classified = await self.run_window(feed.model, feed.name, samples)
            self.run[source] = self.run.get(source, 0) + 1
            if self.metrics is not None:
                self.metrics.source_delay.labels(feed.name).observe(max(0.0, time.time() - last_source_time))
            if feed.write_back and self.writer is not None:
                await self._write_back(source, feed, r, classified)
        except ApplianceError as e:
            outcome = "failed"
            log.info("a window of feed %s was not run: %s", feed.name, e)
        finally:
            self.in_flight[feed.name] -= 1
            if self.metrics is not None:
                self.metrics.source_windows.labels(feed.name, outcome).inc()
            waiting = self.waiting.pop(feed.name, None)
            if waiting is not None:
                self._launch(source, feed, waiting)
            self._show_counts(source)

    def _show_counts(self, source: str) -> None:
        if source in self.latest:
            self.status(self.latest[source])

    async def run_window(self, model: str, feed: str, samples: np.ndarray):
        """The window through the model as Infer runs it; its result where Infer's and Classify's go."""
        svc = self.services[model]
        ctx = CallContext(session=None, method="Watch", model=model)
        answering = self.governance.route(svc, ctx)
        r = await answering.infer(samples, time.monotonic() + self.request_timeout_s)
        classified = None
        if model in self.alarms.classifiers:
            classified = await self.alarms.classified(model, r.output, feed)
        if model in self.governance.drift:
            self.governance.drift_update(model, samples, r.output)
        return r, classified

    async def _write_back(self, source: str, feed, r, classified) -> None:
        """The result into the NodeIds the feed's write_back lists (nothing else is ever written), each write
        audited with its status."""
        values = {"Output": ("Float", [float(v) for v in r.output])}
        if classified is not None:
            values.update(ClassIndex=("Int32", classified.class_index[-1]), Label=("String", classified.label[-1]),
                          Confidence=("Float", classified.confidence[-1]))
        fields = list(feed.write_back)
        targets = self.write_targets[source]
        statuses = await self.writer(source, [targets.index(feed.write_back[f]) for f in fields],
                                     [values[f][0] for f in fields], [values[f][1] for f in fields])
        for field_, status in zip(fields, statuses):
            if self.audit_event is not None:
                value = values[field_][1]
                shown = f"{len(value)} values" if isinstance(value, list) else repr(value)
                self.audit_event("source_write", action="Write", status=status, model=feed.model,
                                 version=r.model_version, detail=f"source {source} feed {feed.name}: {field_} "
                                 f"{shown} -> {feed.write_back[field_]}")
            if status != "Good":
                log.warning("write-back of %s to source %s answered %s", field_, source, status)

    def _start(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
