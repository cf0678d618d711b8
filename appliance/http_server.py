"""The monitoring HTTP endpoint: /metrics (Prometheus), /healthz (liveness), /readyz (readiness) and the status
page at / (appliance/status_page.py). Stdlib asyncio.

One request per connection (HTTP/1.1 with Connection: close). Request heads are bounded (8 KiB) and must arrive
within a read timeout, and connections are capped, so slow or hostile clients cannot hang or exhaust the server.
/healthz never calls the engine: a liveness probe that waits on a busy engine gets a healthy process restarted.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Callable

from .status_page import CONTENT_SECURITY_POLICY, SAMPLE_S, StatusHistory, render

log = logging.getLogger("appliance.http")

MAX_HEAD_BYTES = 8 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
_JSON = "application/json"
_TEXT = "text/plain; charset=utf-8"


class MonitoringServer:
    def __init__(self, host: str, port: int, metrics, readiness: Callable[[], tuple[bool, list[str]]], *,
                 read_timeout_s: float = 5.0, max_connections: int = 64, status: Callable[[], dict] | None = None,
                 ready_details: Callable[[], dict] | None = None):
        """status: the snapshot the page at / shows (Appliance.status_snapshot); without it / is 404."""
        self.host, self.port = host, port
        self._status = status
        self._history = StatusHistory()
        self._sampler: asyncio.Task | None = None
        self._metrics = metrics
        self._readiness = readiness
        self._ready_details = ready_details  # extra fields of /readyz's JSON (the sources that are down)
        self.read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._slots: asyncio.BoundedSemaphore | None = None
        self._server: asyncio.base_events.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._slots = asyncio.BoundedSemaphore(self._max_connections)
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_HEAD_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        if self._status is not None:
            self._sampler = asyncio.create_task(self._sample_loop())
        log.info("monitoring HTTP on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            await asyncio.gather(self._sampler, return_exceptions=True)
            self._sampler = None
        if self._server is None:
            return
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    # ---- one connection -----------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            if self._slots.locked():
                return  # at the connection cap: close at once rather than queue unbounded work
            async with self._slots:
                await self._serve_one(reader, writer)
        except (ConnectionError, TimeoutError, asyncio.CancelledError):
            pass  # the client went away, stopped reading, or the server is stopping
        except Exception:  # noqa: BLE001 - one bad connection must never stop the endpoint
            log.exception("monitoring request failed")
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(OSError):  # reset, broken pipe or 1 s gone by: closed on our side either way
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout_s)
        except asyncio.TimeoutError:
            return await self._send(writer, 408, b"request timeout\n", _TEXT, head_only=False)
        except asyncio.LimitOverrunError:
            return await self._send(writer, 431, b"request head too large\n", _TEXT, head_only=False)
        except asyncio.IncompleteReadError:
            return  # the client went away
        request_line = head.split(b"\r\n", 1)[0]
        parts = request_line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return await self._send(writer, 400, b"bad request\n", _TEXT, head_only=False)
        method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1")
        path = target.split("?", 1)[0]
        if path not in ("/metrics", "/healthz", "/readyz") and not (path == "/" and self._status is not None):
            return await self._send(writer, 404, b"not found\n", _TEXT, head_only=method == "HEAD")
        if method not in ("GET", "HEAD"):
            return await self._send(writer, 405, b"method not allowed\n", _TEXT, head_only=False,
                                    extra={"Allow": "GET, HEAD"})
        accept = ""
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"accept":
                accept = value.strip().decode("latin-1")
        status, body, content_type = self._route(path, accept)
        extra = {"Content-Security-Policy": CONTENT_SECURITY_POLICY} if path == "/" else None
        await self._send(writer, status, body, content_type, head_only=method == "HEAD", extra=extra)

    async def _sample_loop(self) -> None:
        while True:
            try:
                snap = self._status()
                self._history.add(snap["calls"], snap["latency_buckets"])
            except Exception:  # noqa: BLE001 - the daemon's snapshot: logged; the page shows less history
                log.exception("status sample failed")
            await asyncio.sleep(SAMPLE_S)

    def _route(self, path: str, accept: str = "") -> tuple[int, bytes, str]:
        if path == "/":
            try:
                return 200, render(self._status(), self._history).encode(), "text/html; charset=utf-8"
            except Exception:  # noqa: BLE001 - the daemon's snapshot: a failure is logged and answers 500, never a hang
                log.exception("status page failed")
                return 500, b"status unavailable\n", _TEXT
        if path == "/healthz":
            return 200, json.dumps({"status": "ok"}).encode(), _JSON
        if path == "/readyz":
            try:
                ready, reasons = self._readiness()
            except Exception:  # noqa: BLE001 - the daemon's check: any failure means not ready; logged, never shown
                log.exception("readiness check failed")
                ready, reasons = False, ["readiness check failed"]
            details = {}
            if self._ready_details is not None:
                try:
                    details = self._ready_details()
                except Exception:  # noqa: BLE001 - extra information only: logged, left out
                    log.exception("readiness details failed")
            if ready:
                return 200, json.dumps({"ready": True, **details}).encode(), _JSON
            return 503, json.dumps({"ready": False, "reasons": [str(r) for r in reasons], **details}).encode(), _JSON
        try:
            body, content_type = self._metrics.render(accept)
        except Exception:  # noqa: BLE001 - the registry's collectors: a failure is logged and answers 500
            log.exception("metrics rendering failed")
            return 500, b"metrics unavailable\n", _TEXT
        return 200, body, content_type

    async def _send(self, writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str, *,
                    head_only: bool, extra: dict[str, str] | None = None) -> None:
        headers = {"Content-Type": content_type, "Content-Length": str(len(body)), "Connection": "close",
                   "Cache-Control": "no-store", **(extra or {})}
        head = f"HTTP/1.1 {status} {_REASONS[status]}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(head.encode("latin-1") + b"\r\n" + (b"" if head_only else body))
        await asyncio.wait_for(writer.drain(), self.read_timeout_s)  # a client that never reads is dropped
