"""Client-side helpers for the tests: a connected asyncua client per call, raw method results, an event recorder."""
from __future__ import annotations

import asyncio
import contextlib
import time

from asyncua import ua

from appliance.client import call_method, connect, model_node

F = ua.VariantType.Float


@contextlib.asynccontextmanager
async def session(app, cert, key, **kw):
    client = await connect(app.endpoint, cert, key, **kw)
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.disconnect()


async def call(client, model: str, method: str, args: list) -> ua.CallMethodResult:
    if model:
        parent, ns = await model_node(client, model)
    else:
        ns = await client.get_namespace_index("urn:opcua-inference-appliance")
        parent = await client.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Admin"])
    node = await parent.get_child(f"{ns}:{method}")
    return await call_method(client, parent, node, args)


async def read(client, *path: str):
    ns = await client.get_namespace_index("urn:opcua-inference-appliance")
    node = await client.nodes.objects.get_child([f"{ns}:{p}" for p in ("Appliance",) + path])
    return await node.read_value()


def floats(values) -> ua.Variant:
    return ua.Variant([float(v) for v in values], F)


def status_name(result: ua.CallMethodResult) -> str:
    return result.StatusCode.name


def arg_statuses(result: ua.CallMethodResult) -> list[str]:
    return [s.name for s in result.InputArgumentResults]


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Events:
    """asyncua subscription handler that records every event (each stamped `arrived_at`, time.time() on arrival);
    `next` waits for one matching a predicate and takes it off the list; `messages` are their Message texts."""

    def __init__(self):
        self.events: list = []
        self.arrived = asyncio.Event()

    def event_notification(self, event) -> None:
        event.arrived_at = time.time()
        self.events.append(event)
        self.arrived.set()

    def messages(self) -> list[str]:
        return [str(e.Message.Text) for e in self.events]

    async def next(self, predicate, timeout: float = 10.0):
        async def wait():
            while True:
                for e in self.events:
                    if predicate(e):
                        self.events.remove(e)
                        return e
                self.arrived.clear()
                await self.arrived.wait()
        return await asyncio.wait_for(wait(), timeout)


def field(event, name: str):
    """An event's field by its select-clause name ("ActiveState/Id"), None where the event has none."""
    return getattr(event, name, None)
