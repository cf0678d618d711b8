"""The service's side of the systemd notify protocol: READY=1 once no model is Loading (each is Ready or Failed),
EXTEND_TIMEOUT_USEC while they load, WATCHDOG=1 only while this loop turns and the supervision of the workers runs,
STATUS= as things change (appliance/sdnotify.py is the protocol itself)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .daemon import Appliance

LOAD_EXTENSION_S = 60.0  # a first start may compile or lay out weights for a while


async def tell_systemd(app: "Appliance", notifier, load_extension_s: float = LOAD_EXTENSION_S) -> None:
    if not notifier.enabled:
        return
    loop = asyncio.get_running_loop()
    last_extend = last_ping = 0.0
    ready = False
    last_status = ""
    while True:
        now = loop.time()
        loading = any(m.status().state == "Loading" for m in app.services.values())
        if not ready and loading and now - last_extend > load_extension_s / 3:
            notifier.extend_timeout(load_extension_s)
            last_extend = now
        line = app.supervision.status_line()
        if not ready and not loading:
            notifier.ready(line)
            ready = True
        if ready and line != last_status:
            notifier.status(line)
        last_status = line
        interval = notifier.watchdog_interval_s
        if interval and now - last_ping >= interval and app.supervision.alive():
            notifier.watchdog()
            last_ping = now
        await asyncio.sleep(min(0.5, interval or 0.5))
