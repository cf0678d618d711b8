"""The serve process <-> model worker protocol, and the only module that knows the transport.

A connected pair of Unix stream sockets (socketpair; the child inherits its end). Each message is a 4-byte
big-endian length and a msgspec MessagePack body; msgspec tags each struct with its class name, so one decoder
reads every message of a direction. Tensors travel as raw float32 bytes (an Infer of 64 TE samples is 266 KB;
copying it is ~20 us, less than a shared-memory handshake would cost here).

Deadlines are `time.monotonic()` seconds: CLOCK_MONOTONIC is one clock for every process of the machine.
"""
from __future__ import annotations

import asyncio
import struct
from typing import Union

import msgspec

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


ToWorker = Union[Start, Infer, Generate, Reset, Release, Reload, ShedLoad, Cancel, Ping, Stop]


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


class GenerateProgress(_Msg):
    id: int
    text: str
    token_count: int


class Done(_Msg):
    id: int
    value: str = ""


class Failed(_Msg):
    id: int
    reason: str  # appliance.errors reason
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


FromWorker = Union[InferDone, GenerateDone, GenerateProgress, Done, Failed, Pong, Event]


class Channel:
    """One end of the connection, on an asyncio loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incoming: type):
        self._reader = reader
        self._writer = writer
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._outbox: list[bytes] = []

    @classmethod
    async def open(cls, sock, incoming: type) -> "Channel":
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        return cls(reader, writer, incoming)

    def send(self, message: _Msg) -> None:
        """Queue a message; the messages of one loop turn leave in one write at its end (profiled: a socket write
        per message was a third of the serve process's CPU at 16 clients; a turn often answers several calls)."""
        if self._writer.is_closing():
            raise ConnectionResetError("the worker connection is closed")
        body = self._encoder.encode(message)
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(_LENGTH.pack(len(body)))
        self._outbox.append(body)

    def _flush(self) -> None:
        data, self._outbox = b"".join(self._outbox), []
        if not self._writer.is_closing():
            self._writer.write(data)

    async def drain(self) -> None:
        if self._outbox:
            self._flush()
        await self._writer.drain()

    async def receive(self):
        """The next message; raises EOFError when the other side has gone."""
        try:
            header = await self._reader.readexactly(_LENGTH.size)
            (length,) = _LENGTH.unpack(header)
            if length > MAX_MESSAGE_BYTES:
                raise EOFError(f"message of {length} bytes announced")
            body = await self._reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise EOFError("connection closed") from exc
        try:
            return self._decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise EOFError(f"undecodable message: {exc}") from exc

    def close(self) -> None:
        try:
            self._writer.close()
        except Exception:
            pass
