"""The sources client process: `python -m appliance.sources.process --fd N` (started by supervisor.py).

Every configured source's client runs here on one asyncio loop, outside serve's: a source that hangs, floods or
crashes this process never stalls a method call. Complete windows, each source's status (at every change and once a
second) and answers to Pings go to serve over the socketpair; the process ends when serve's end closes.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from . import protocol as p
from .client import SourceClient

log = logging.getLogger("appliance.sources.process")
STATUS_EVERY_S = 1.0


async def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    channel = await p.Channel.open(sock, p.ToSources)
    start = await channel.receive()
    if not isinstance(start, p.Start):
        raise SystemExit("the first message was not Start")
    from appliance.logs import configure_logging
    configure_logging(start.log_level, start.log_format)
    logging.getLogger("asyncua").setLevel(logging.CRITICAL)  # every source's failure is its LastError instead
    ended = asyncio.get_running_loop().create_future()

    def send(message) -> None:
        try:
            channel.send(message)
        except ConnectionError:
            if not ended.done():
                ended.set_result(None)

    clients: list[SourceClient] = []

    def window(w) -> None:
        send(p.WindowReady(feed=w.feed, rows=int(w.data.shape[0]), columns=int(w.data.shape[1]),
                           data=w.data.tobytes(), last_source_time=w.last_source_time))

    for spec in start.sources:
        client = SourceClient(spec, window, lambda: None)
        client.on_status = (lambda c: lambda: send(c.status()))(client)
        clients.append(client)

    by_name = {c.spec.name: c for c in clients}
    writes: set[asyncio.Task] = set()

    async def write(message: p.Write) -> None:
        client = by_name.get(message.source)
        statuses = (await client.write(message.nodes, message.types, message.values) if client is not None
                    else ["BadNotFound"] * len(message.nodes))
        send(p.Written(id=message.id, statuses=statuses))

    def on_message(message) -> None:
        if isinstance(message, p.Ping):
            send(p.Pong(seq=message.seq))
        elif isinstance(message, p.Write):
            task = asyncio.get_running_loop().create_task(write(message))
            writes.add(task)
            task.add_done_callback(writes.discard)

    channel.listen(on_message, lambda reason: ended.done() or ended.set_result(None))
    tasks = [asyncio.create_task(c.run(), name=f"source-{c.spec.name}") for c in clients]
    for c in clients:
        send(c.status())
    try:
        while not ended.done():
            for c in clients:
                c.check_stale()
                send(c.status())
            await asyncio.wait({ended}, timeout=STATUS_EVERY_S)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    from appliance.workers.os_setup import WORKER_NICE, die_with_parent
    die_with_parent(args.parent_pid)  # no source client outlives serve
    try:
        os.nice(WORKER_NICE)  # as the model workers: a PLC's method call comes before the watched windows' intake
    except OSError:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # serve decides when this process stops (see the workers')
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        asyncio.run(serve(args.fd))
    except (EOFError, ConnectionError):
        pass
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
