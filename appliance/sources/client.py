"""One source, in the sources client process: connect, resolve, subscribe, check every sample, cut the feeds'
windows, and come back after any failure with a bounded back-off.

Back-off: `reconnect_min_s` (0.5 s) after a failure, doubled after each failure in a row up to `reconnect_max_s`
(30 s); a connection that stayed up for 10 s or more starts the next back-off at the minimum again. Every
(re)connect resolves the nodes anew (namespace URIs and browse paths) and creates the subscription anew; the feeds
restart at a reconnect (counted as a gap), so no window spans it.

A sample is checked before it reaches a feed: an array longer than `max_array_length` or a string longer than
`max_string_length` disconnects the source (a hostile or broken server), as does a message over the client's
decode limits (session.connect). The subscription's queue in this process is bounded: a consumer that falls behind
is a disconnect and a gap, never a silent loss.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone

from asyncua import ua
from asyncua.common.subscription import DataChangeEvent, OverflowPolicy, StatusChangeEvent

from . import protocol as p
from .session import SourceProblem, check_size, connect, read_once, resolve
from .windows import FeedSpec, FeedWindows, Window, severity

log = logging.getLogger(__name__)
STAYED_UP_S = 10.0  # a connection that lasted this long resets the back-off
QUEUE_EVENTS = 200_000  # notifications waiting in this process, at most (beyond: disconnect, a visible gap)


class SourceClient:
    def __init__(self, spec: p.SourceSpec, on_window: Callable[[Window], None], on_status: Callable[[], None]):
        self.spec = spec
        self.on_window = on_window
        self.on_status = on_status  # the state or an error changed: tell serve now
        self.state = "Connecting" if spec.enabled else "Disabled"
        self.error = ""
        self.samples = 0
        self.reconnects = 0
        self.feeds = [FeedWindows(FeedSpec(
            name=f.name, columns=len(f.columns), window=f.window, stride=f.stride, triggered=f.trigger >= 0,
            trigger_kind=f.trigger_kind, tolerance_s=f.tolerance_s, missing=f.missing,
            stale_after_s=spec.stale_after_s, accept_uncertain=spec.accept_uncertain)) for f in spec.feeds]
        # node index -> [(feed, column)] and node index -> [feed] it triggers
        self._columns: dict[int, list[tuple[FeedWindows, int]]] = {}
        self._triggers: dict[int, list[FeedWindows]] = {}
        for f, fw in zip(spec.feeds, self.feeds):
            for c, node in enumerate(f.columns):
                self._columns.setdefault(node, []).append((fw, c))
            if f.trigger >= 0:
                self._triggers.setdefault(f.trigger, []).append(fw)
        self._not_good: set[int] = set()  # nodes whose latest sample is not usable (BadData while any)
        self._violation = ""  # why the connection was cut by a decode limit
        self._connected_once = False  # a later connection is a reconnect
        self._client = None  # the connected client while subscribed (writes go through it)
        self._write_ids: list[ua.NodeId] = []  # the write-back NodeIds, resolved on this connection
        self._up = False  # the current connection got as far as subscribing

    # ---- what serve sees ----

    def status(self) -> p.SourceStatus:
        skipped: dict[str, int] = {}
        for fw in self.feeds:
            for reason, n in fw.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
        return p.SourceStatus(source=self.spec.name, state=self.state, error=self.error, samples=self.samples,
                              windows=sum(fw.windows for fw in self.feeds), skipped=skipped,
                              reconnects=self.reconnects)

    def _set(self, state: str, error: str | None = None) -> None:
        changed = state != self.state or (error is not None and error != self.error)
        self.state = state
        if error is not None:
            self.error = error
        if changed:
            self.on_status()

    # ---- the loop ----

    async def run(self) -> None:
        if not self.spec.enabled:
            self._set("Disabled")
            return
        delay = self.spec.reconnect_min_s
        while True:
            started = time.monotonic()
            self._up = False
            try:
                await self._session()
            except SourceProblem as e:
                self._set(e.state, str(e))
            except asyncio.CancelledError:
                raise
            except (OSError, asyncio.TimeoutError, ua.UaError) as e:  # the connection broke, or a limit was hit
                self._set("Connecting", self._violation or f"the connection failed: {type(e).__name__} {e}".strip())
            except Exception as e:  # noqa: BLE001 - any failure of one source is its LastError, then a retry
                log.exception("source %s failed", self.spec.name)
                self._set("Connecting", f"{type(e).__name__}: {e}")
            for fw in self.feeds:
                fw.gap()
            self._not_good.clear()
            if self.state not in ("Refused",):
                self._set("Connecting")
            if self._up and time.monotonic() - started >= STAYED_UP_S:
                delay = self.spec.reconnect_min_s
            log.info("source %s: next attempt in %.2f s", self.spec.name, delay)
            await asyncio.sleep(delay)
            delay = min(self.spec.reconnect_max_s, delay * 2)

    async def _session(self) -> None:
        """One connection, until it is lost (raises why); self._up tells whether it got as far as subscribing."""
        self._violation = ""
        client = await connect(self.spec, on_violation=self._on_violation)
        lost = asyncio.Event()

        async def on_lost(exc: Exception) -> None:
            lost.set()
        client.connection_lost_callback = on_lost
        try:
            nodeids = await resolve(client, self.spec)
            await read_once(client, self.spec, nodeids)
            self._write_ids = await resolve(client, self.spec, self.spec.writes) if self.spec.writes else []
            sub = await client.create_subscription(self.spec.publishing_interval_ms, None,
                                                   queue_maxsize=QUEUE_EVENTS, overflow=OverflowPolicy.DISCONNECT)
            await self._monitor(client, sub, nodeids)
            if self._connected_once:
                self.reconnects += 1
            self._connected_once = self._up = True
            self._set("Connected", "")
            self._client = client
            consumer = asyncio.create_task(self._consume(sub))
            waiter = asyncio.create_task(lost.wait())
            try:
                await asyncio.wait({consumer, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                consumer.cancel()
                waiter.cancel()
                await asyncio.gather(consumer, waiter, return_exceptions=True)
            if consumer.done() and not consumer.cancelled() and consumer.exception() is not None:
                raise consumer.exception()
            raise SourceProblem(self._violation or "the connection to the source was lost")
        finally:
            self._client = None
            try:
                await asyncio.wait_for(client.disconnect(), 2)
            except Exception:  # noqa: BLE001 - the connection is gone or broken: nothing more to close
                pass

    async def write(self, nodes: list[int], types: list[str], values: list) -> list[str]:
        """Write results into the source's write-back NodeIds (indices into spec.writes): each status's name.
        Values only, no timestamps (PLC servers refuse written timestamps)."""
        client = self._client
        if client is None or len(self._write_ids) != len(self.spec.writes):
            return ["BadNotConnected"] * len(nodes)
        params = ua.WriteParameters()
        for i, vtype, value in zip(nodes, types, values):
            wv = ua.WriteValue()
            wv.NodeId, wv.AttributeId = self._write_ids[i], ua.AttributeIds.Value
            wv.Value = ua.DataValue(ua.Variant(value, getattr(ua.VariantType, vtype)))
            params.NodesToWrite.append(wv)
        try:
            results = await asyncio.wait_for(client.uaclient.write(params), self.spec.timeout_s)
        except ua.UaStatusCodeError as e:
            return [ua.StatusCode(e.code).name] * len(nodes)
        except (OSError, asyncio.TimeoutError, ua.UaError):
            return ["BadCommunicationError"] * len(nodes)
        return [r.name for r in results]

    def _on_violation(self, reason: str) -> None:
        self._violation = reason

    async def _monitor(self, client, sub, nodeids: list[ua.NodeId]) -> None:
        """A monitored item per configured node (its quality shows in State even when no feed uses it): its sampling
        interval, queue and deadband; every sampled value reported (DataChangeTrigger StatusValueTimestamp) unless a
        deadband filters it."""
        requests = []
        for i, (node, nodeid) in enumerate(zip(self.spec.nodes, nodeids)):
            flt = ua.DataChangeFilter()
            if node.deadband >= 0:
                flt.Trigger = ua.DataChangeTrigger.StatusValue
                flt.DeadbandType = ua.DeadbandType.Absolute
                flt.DeadbandValue = node.deadband
            else:
                flt.Trigger = ua.DataChangeTrigger.StatusValueTimestamp
            requests.append(_item_request(i + 1, nodeid, node, flt))
        results = await sub.create_monitored_items(requests)
        for node_spec, result in zip(self.spec.nodes, results):
            if isinstance(result, ua.StatusCode) and not result.is_good():
                raise SourceProblem(f"node {node_spec.name}: the server refused to monitor it ({result.name})")

    async def _consume(self, sub) -> None:
        n_nodes = len(self.spec.nodes)
        async for event in sub:
            if isinstance(event, StatusChangeEvent):
                status = event.notification.Status
                raise SourceProblem(f"the source ended the subscription ({status.name})")
            if not isinstance(event, DataChangeEvent):
                continue
            item = event.data.monitored_item
            index = item.ClientHandle - 1
            if not 0 <= index < n_nodes:
                continue
            dv = item.Value
            value = event.value
            if isinstance(value, (list, tuple, str, bytes)):
                check_size(self.spec, self.spec.nodes[index].name, value)
            self.samples += 1
            code = dv.StatusCode.value if dv.StatusCode is not None else 0
            self._quality(index, code)
            when = _unix(dv.SourceTimestamp or dv.ServerTimestamp)
            for fw in self._triggers.get(index, ()):
                self._emit(fw.trigger(value, code))
            for fw, column in self._columns.get(index, ()):
                self._emit(fw.sample(column, value, code, when))

    def _quality(self, index: int, code: int) -> None:
        sev = severity(code)
        usable = sev == "Good" or (sev == "Uncertain" and self.spec.accept_uncertain)
        before = bool(self._not_good)
        if usable:
            self._not_good.discard(index)
        else:
            self._not_good.add(index)
        if bool(self._not_good) != before:
            if self._not_good:
                names = ", ".join(self.spec.nodes[i].name for i in sorted(self._not_good)[:5])
                self._set("BadData", f"{ua.StatusCode(code).name} from node(s) {names}: windows are skipped")
            else:
                self._set("Connected", "")

    def _emit(self, windows: list[Window] | Window | None) -> None:
        for window in windows if isinstance(windows, list) else [windows] if windows is not None else []:
            self.on_window(window)

    def check_stale(self) -> None:
        now = time.monotonic()
        for fw in self.feeds:
            if self.state in ("Connected", "BadData"):
                fw.check_stale(now)


def _item_request(handle: int, nodeid: ua.NodeId, spec: p.NodeSpec, flt) -> ua.MonitoredItemCreateRequest:
    """handle: the node's index + 1 (our own client handles; asyncua's subscribe_* are not used here)."""
    rv = ua.ReadValueId()
    rv.NodeId, rv.AttributeId = nodeid, ua.AttributeIds.Value
    params = ua.MonitoringParameters()
    params.ClientHandle = handle
    params.SamplingInterval = spec.sampling_interval_ms
    params.QueueSize = spec.queue_size
    params.DiscardOldest = True
    params.Filter = flt
    req = ua.MonitoredItemCreateRequest()
    req.ItemToMonitor, req.MonitoringMode, req.RequestedParameters = rv, ua.MonitoringMode.Reporting, params
    return req


def _unix(when: datetime | None) -> float:
    if when is None:
        return time.time()
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()
