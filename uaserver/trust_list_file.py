"""The DefaultApplicationGroup's TrustList as a file (Part 5 FileType + Part 12 TrustListType): its handles, reads,
writes and positions, and CloseAndUpdate, which applies what was written to the pki/ folders at once.

The file's content is a TrustListDataType, UA Binary encoded. A handle belongs to the session that opened it. Only
Read (1) and Write + EraseExisting (6) are valid modes (Part 12); one writer at a time, and nobody reads while it
writes. The method bodies raise MethodStatus with the standard status codes; server_configuration.py wraps them.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from asyncua import ua

from certs.trust_list_update import ALL, TrustListContent, TrustListFolders, TrustListRefused

from .asyncua_internals import trust_list_from_binary, trust_list_to_binary
from .methods import MethodStatus

log = logging.getLogger(__name__)

READ, WRITE, ERASE_EXISTING = 1, 2, 4
MAX_TRUST_LIST_SIZE = 1024 * 1024  # bytes; the ServerConfiguration's MaxTrustListSize says so
MAX_HANDLES = 16  # open handles at once, all sessions together


@dataclass
class OpenFile:
    session_key: str
    writing: bool
    data: bytearray
    position: int = 0


def encode(content: TrustListContent) -> bytes:
    value = ua.TrustListDataType(SpecifiedLists=content.specified, TrustedCertificates=content.trusted_certificates,
                                 TrustedCrls=content.trusted_crls, IssuerCertificates=content.issuer_certificates,
                                 IssuerCrls=content.issuer_crls)
    return trust_list_to_binary(value)


def decode(data: bytes) -> TrustListContent:
    """MethodStatus BadDecodingError for bytes that are not exactly one TrustListDataType (a truncated file)."""
    try:
        value = trust_list_from_binary(data)
    except ValueError:
        raise MethodStatus("BadDecodingError") from None
    if not isinstance(value.SpecifiedLists, int) or value.SpecifiedLists & ~ALL:
        raise MethodStatus("BadDecodingError")
    return TrustListContent(value.SpecifiedLists, *(list(v or []) for v in (
        value.TrustedCertificates, value.TrustedCrls, value.IssuerCertificates, value.IssuerCrls)))


class TrustListFile:
    """live_sessions() -> the keys of the sessions open now (a dead session's handles are dropped)."""

    def __init__(self, folders: TrustListFolders, live_sessions: Callable[[], set[str]]):
        self.folders = folders
        self.live_sessions = live_sessions
        self.handles: dict[int, OpenFile] = {}
        self._next = itertools.count(1)
        self.last_update = datetime.now(timezone.utc)

    @property
    def writer_open(self) -> bool:
        return any(f.writing for f in self.handles.values())

    def open(self, session_key: str, mode: int, masks: int = ALL) -> int:
        self._drop_dead()
        if mode == READ:
            if self.writer_open:
                raise MethodStatus("BadNotReadable")
            data = encode(self.folders.read().masked(masks))
        elif mode == WRITE | ERASE_EXISTING:
            if self.handles:
                raise MethodStatus("BadNotWritable")
            data = b""
        else:
            raise MethodStatus("BadInvalidArgument")  # Part 12: Read, or Write + EraseExisting, nothing else
        if len(self.handles) >= MAX_HANDLES:
            raise MethodStatus("BadTooManyOperations")
        handle = next(self._next)
        self.handles[handle] = OpenFile(session_key, mode != READ, bytearray(data))
        return handle

    def _drop_dead(self) -> None:
        live = self.live_sessions()
        for handle, f in list(self.handles.items()):
            if f.session_key not in live:
                del self.handles[handle]

    def _file(self, session_key: str, handle: int) -> OpenFile:
        f = self.handles.get(handle)
        if f is None or f.session_key != session_key:
            raise MethodStatus("BadInvalidArgument")  # Part 5: an invalid file handle
        return f

    def read(self, session_key: str, handle: int, length: int) -> bytes:
        f = self._file(session_key, handle)
        if f.writing:
            raise MethodStatus("BadInvalidState")
        if length < 0:
            raise MethodStatus("BadInvalidArgument")
        chunk = bytes(f.data[f.position:f.position + length])
        f.position += len(chunk)
        return chunk

    def write(self, session_key: str, handle: int, data: bytes) -> None:
        f = self._file(session_key, handle)
        if not f.writing:
            raise MethodStatus("BadInvalidState")
        end = f.position + len(data)
        if end > MAX_TRUST_LIST_SIZE:
            raise MethodStatus("BadEncodingLimitsExceeded")
        f.data[f.position:end] = data
        f.position = end

    def get_position(self, session_key: str, handle: int) -> int:
        return self._file(session_key, handle).position

    def set_position(self, session_key: str, handle: int, position: int) -> None:
        f = self._file(session_key, handle)
        f.position = min(max(position, 0), len(f.data))  # Part 5: past the end means the end

    def close(self, session_key: str, handle: int) -> None:
        self._file(session_key, handle)
        del self.handles[handle]

    async def close_and_update(self, session_key: str, handle: int) -> TrustListContent:
        """Apply what was written: all of it or nothing. The handle is closed either way. The parsing, writing and
        fsyncs run in a thread (a 1,000-entry list takes seconds on a slow disk): every session is answered
        meanwhile; the caller holds the lock that keeps other changes of the folders out."""
        f = self._file(session_key, handle)
        if not f.writing:
            raise MethodStatus("BadInvalidState")
        del self.handles[handle]
        content = decode(f.data)
        try:
            await asyncio.to_thread(self.folders.replace, content)
        except TrustListRefused as refused:
            log.warning("trust list update refused: %s", refused.reason)
            raise MethodStatus(refused.status) from None
        self.last_update = datetime.now(timezone.utc)
        return content

    async def add_certificate(self, der: bytes, trusted: bool) -> None:
        self._refuse_while_open()
        try:
            await asyncio.to_thread(self.folders.add_certificate, der, trusted)
        except TrustListRefused as refused:
            raise MethodStatus(refused.status) from None
        self.last_update = datetime.now(timezone.utc)

    async def remove_certificate(self, thumb: str, trusted: bool) -> None:
        self._refuse_while_open()
        try:
            await asyncio.to_thread(self.folders.remove_certificate, thumb, trusted)
        except TrustListRefused as refused:
            raise MethodStatus(refused.status) from None
        self.last_update = datetime.now(timezone.utc)

    def _refuse_while_open(self) -> None:
        self._drop_dead()
        if self.handles:
            raise MethodStatus("BadInvalidState")  # Part 12: not while the TrustList is open

    def size(self) -> int:
        return len(encode(self.folders.read()))
