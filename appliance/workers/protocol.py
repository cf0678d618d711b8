"""The serve process <-> model worker protocol, and the only module that knows the transport.

A connected pair of Unix stream sockets (socketpair; the child inherits its end). Each message is a 4-byte
big-endian length and a msgspec MessagePack body; msgspec tags each struct with its class name, so one decoder
reads every message of a direction. Tensors travel as raw float32 bytes (an Infer of 64 TE samples is 266 KB;
copying it is ~20 us, less than a shared-memory handshake would cost here).

Deadlines are `time.monotonic()` seconds: CLOCK_MONOTONIC is one clock for every process of the machine.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import struct
from collections.abc import Callable
from typing import Union

import msgspec

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # far above any legitimate message; a corrupt length ends the connection
_LENGTH = struct.Struct(">I")


class _Msg(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    pass


# ---- serve -> worker ----

class ModelSpec(msgspec.Struct, array_like=True):
    name: str
    kind: str  # tensor | generative
    path: str
    version_label: str | None
    settings: dict  # the service's keyword settings (plain values only)
    refused: str = ""  # not to be loaded: the reason (the model is Failed with it)


class Start(_Msg):
    models: list[ModelSpec]
    memory_mb: int  # 0: no limit
    threads: int  # torch / ONNX Runtime intra-op threads, 0: the library's default
    log_level: str
    log_format: str = "text"  # text | json


class Infer(_Msg):
    id: int
    model: str
    data: bytes  # float32 samples back to back
    deadline: float


class Generate(_Msg):
    id: int
    model: str
    session: str
    prompt: str
    max_tokens: int
    temperature: float
    deadline: float
    progress: bool = False  # send GenerateProgress as the reply grows (jobs show partial text)
    finish_by: float = 0.0  # a job's bound (monotonic; 0: none): the reply ends there as it is ("deadline")
    grammar: str = ""  # a JSON Schema (JSON text) the reply must match ("": free text)


class Choose(_Msg):
    id: int
    model: str
    prompt: str
    options: list[str]
    deadline: float


class Reset(_Msg):
    id: int
    model: str
    session: str


class Release(_Msg):  # no answer: a session closed
    model: str
    session: str


class Reload(_Msg):
    id: int
    model: str
    path: str  # where the weights are now (a deployed version may have been switched)
    version_label: str | None = None  # the deployed version's name, else the YAML's label


class ShedLoad(_Msg):  # no answer: the GPU watchdog is Critical (True) or no longer (False)
    model: str
    on: bool


class Cancel(_Msg):  # no answer: the caller stopped waiting for request `id`
    id: int


class Ping(_Msg):
    seq: int


class Stop(_Msg):
    id: int


ToWorker = Union[Start, Infer, Generate, Choose, Reset, Release, Reload, ShedLoad, Cancel, Ping, Stop]


# ---- worker -> serve ----

class ModelSnapshot(msgspec.Struct, array_like=True, omit_defaults=True):
    name: str
    state: str  # Loading | Ready | Failed
    version: str = ""
    backend: str = ""
    failure_reason: str = ""
    input_shape: list[int] = []
    output_shape: list[int] = []
    queue_depth: int = 0
    slots_total: int = 0
    slots_in_use: int = 0
    conversations_parked: int = 0


class InferDone(_Msg):
    id: int
    data: bytes  # float32 results back to back
    version: str


class GenerateDone(_Msg):
    id: int
    text: str
    token_count: int
    finish_reason: str
    context_tokens: int
    context_lost: bool
    version: str


class ChooseDone(_Msg):
    id: int
    index: int
    scores: list[float]
    version: str


class GenerateProgress(_Msg):
    id: int
    text: str
    token_count: int


class Done(_Msg):
    id: int
    value: str = ""


class Failed(_Msg):
    id: int
    reason: str  # core.errors reason
    message: str
    index: int = 0
    kind: str = "out_of_range"


class Pong(_Msg):
    seq: int  # 0: sent unprompted because a model's state changed
    busy_since: float  # when the oldest engine operation now running began (monotonic; 0: none runs)
    models: list[ModelSnapshot]
    # engine metric records since the last Pong: (metric attribute, label values, operation, value)
    records: list[tuple[str, list[str], str, float]] = []


class Event(_Msg):
    model: str
    kind: str
    message: str


FromWorker = Union[InferDone, GenerateDone, ChooseDone, GenerateProgress, Done, Failed, Pong, Event]


class Channel(asyncio.Protocol):
    """One end of the connection, on an asyncio loop. Messages are decoded as their bytes arrive (in the
    transport's read callback) and handed to the `listen` handler at once; before one is set they wait for
    `receive()`. Profiled in the serve process at 16 clients: a reader task over a StreamReader (two awaited reads
    per message, a loop turn to wake it) was 6 % of its CPU, and the worker's loop pays the same per request."""

    def __init__(self, incoming: type):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._outbox: list[bytes] = []
        self._partial = bytearray()  # the start of a message whose bytes have not all arrived
        self._transport: asyncio.Transport | None = None
        self._handler: Callable[[object], None] | None = None
        self._on_closed: Callable[[str], None] | None = None
        self._inbox: collections.deque = collections.deque()  # decoded, no handler yet
        self._waiter: asyncio.Future | None = None  # receive() waiting for a message
        self._writable: asyncio.Future | None = None  # drain() waiting for the transport's buffer to empty
        self.closed_reason = ""  # why the connection ended ("" while open)

    @classmethod
    async def open(cls, sock, incoming: type) -> "Channel":
        loop = asyncio.get_running_loop()
        _, channel = await loop.create_unix_connection(lambda: cls(incoming), sock=sock)
        return channel

    # ---- receiving ----

    def listen(self, handler: Callable[[object], None], on_closed: Callable[[str], None] | None = None) -> None:
        """From now on every message goes to handler(message) as it is decoded (messages that waited for
        receive() first), and on_closed(reason) is called once when the connection ends."""
        self._handler, self._on_closed = handler, on_closed
        while self._inbox:
            self._deliver(self._inbox.popleft())
        if self.closed_reason and on_closed is not None:
            on_closed(self.closed_reason)

    async def receive(self):
        """The next message (before `listen`); raises EOFError when the other side has gone."""
        while not self._inbox:
            if self.closed_reason:
                raise EOFError(self.closed_reason)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._inbox.popleft()

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self._partial:
            self._partial += data
            if len(self._partial) < _LENGTH.size:
                return
            (length,) = _LENGTH.unpack_from(self._partial, 0)
            if length <= MAX_MESSAGE_BYTES and len(self._partial) < _LENGTH.size + length:
                return  # a large message arriving in pieces: gathered, decoded once whole
            data, self._partial = bytes(self._partial), bytearray()
        view, offset, size = memoryview(data), 0, len(data)
        while size - offset >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(data, offset)
            if length > MAX_MESSAGE_BYTES:
                self._abort(f"message of {length} bytes announced")
                return
            end = offset + _LENGTH.size + length
            if end > size:
                break
            try:
                message = self._decoder.decode(view[offset + _LENGTH.size:end])
            except msgspec.DecodeError as exc:
                self._abort(f"undecodable message: {exc}")
                return
            offset = end
            if self._handler is not None:
                self._deliver(message)
            else:
                self._inbox.append(message)
                if self._waiter is not None and not self._waiter.done():
                    self._waiter.set_result(None)
        if offset < size:
            self._partial += view[offset:]

    def _deliver(self, message) -> None:
        try:
            self._handler(message)
        except Exception:  # noqa: BLE001 - one message's bug must not end the connection (every call in flight)
            log.exception("handling %s from the other process failed", type(message).__name__)

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(f"connection closed ({exc})" if exc else "connection closed")

    def _abort(self, reason: str) -> None:
        log.error("the connection to the other process is broken: %s", reason)
        self._ended(reason)
        if self._transport is not None:
            self._transport.abort()

    def _ended(self, reason: str) -> None:
        if self.closed_reason:
            return
        self.closed_reason = reason
        self._handler = None  # nothing after the end is delivered (a torn message)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if self._on_closed is not None:
            self._on_closed(reason)

    # ---- sending ----

    def send(self, message: _Msg) -> None:
        """Queue a message; the messages of one loop turn leave in one write at its end (profiled: a socket write
        per message was a third of the serve process's CPU at 16 clients; a turn often answers several calls)."""
        if self.closed_reason or self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the worker connection is closed")
        body = self._encoder.encode(message)
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(_LENGTH.pack(len(body)))
        self._outbox.append(body)

    def _flush(self) -> None:
        data, self._outbox = b"".join(self._outbox), []
        if data and not self.closed_reason and not self._transport.is_closing():
            self._transport.write(data)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    async def drain(self) -> None:
        """Write what is queued and wait until the transport has handed it to the socket."""
        if self._outbox:
            self._flush()
        if self.closed_reason:
            raise ConnectionResetError(self.closed_reason)
        if self._writable is not None and not self._writable.done():
            await self._writable
            if self.closed_reason:
                raise ConnectionResetError(self.closed_reason)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
