"""asyncua's binary decoder bounded in depth, and the Call service's own codec (items 1 and 8 of the package's list)."""
from __future__ import annotations

import contextvars
import functools
import logging
import struct
import threading
from collections.abc import Callable

import numpy as np
from asyncua import ua
from asyncua.ua import ua_binary
from asyncua.ua.ua_binary import Primitives, nodeid_from_binary, nodeid_to_binary, struct_to_binary
from asyncua.ua.uaerrors import BadDecodingError

log = logging.getLogger(__name__)


# ==============================================================================================================
# The decoder's nesting limit
#
# A bound on how deeply a received message may nest Variants, ExtensionObjects, DataValues and DiagnosticInfos.
#
# asyncua decodes those recursively (ua_binary.variant_from_binary -> unpack_uatype -> extensionobject_from_binary ->
# struct decoders -> variant_from_binary ...; DiagnosticInfo holds an InnerDiagnosticInfo), so a crafted message of a
# few kilobytes could drive the decoder as deep as Python's recursion limit allows. No method of the appliance takes
# anything but scalars and one-dimensional arrays of built-in types, and no service needs more than a few levels.
#
# `install_nesting_limit(depth)` patches asyncua's binary decoder FOR THE WHOLE PROCESS (clients in the same process
# included): each of those decoders counts its depth in a contextvar and raises NestingTooDeep (BadDecodingError)
# past the limit. The server calls it once at start; calling it again only changes the limit. The decoders asyncua
# builds are cached closures that captured the original functions, so the caches are cleared once after patching.

DEFAULT_MAX_NESTING_DEPTH = 8


class NestingTooDeep(BadDecodingError):
    """A message nests deeper than security.limits.max_nesting_depth."""


_depth: contextvars.ContextVar[int] = contextvars.ContextVar("ua_decode_depth", default=0)
_limit = DEFAULT_MAX_NESTING_DEPTH
_install_lock = threading.Lock()
_installed = False
# Structures whose decoders recurse without passing through a Variant or an ExtensionObject.
_COUNTED_STRUCTS = ("DataValue", "DiagnosticInfo")
_ASYNCUA_MAX_RESHAPE_ELEMENTS = ua_binary.MAX_RESHAPE_ELEMENTS


def max_nesting_depth() -> int:
    return _limit


def _counted(decode: Callable) -> Callable:
    @functools.wraps(decode)
    def counted(data):
        depth = _depth.get() + 1
        if depth > _limit:
            raise NestingTooDeep(f"message nests deeper than {_limit} levels")
        token = _depth.set(depth)
        try:
            return decode(data)
        finally:
            _depth.reset(token)
    counted.__wrapped_by_nesting_limit__ = True  # type: ignore[attr-defined]
    return counted


def install_nesting_limit(depth: int, max_array_length: int | None = None) -> None:
    """Enforce `depth` from now on in this process (see the module docstring). With max_array_length, a Variant's
    ArrayDimensions may also declare no more elements than that (asyncua pads a short array with empty lists up to
    the declared size: up to a million of them, ~60 MB, per message by default)."""
    global _limit, _installed
    if depth < 1:
        raise ValueError("max_nesting_depth must be >= 1")
    with _install_lock:
        _limit = int(depth)
        if max_array_length is not None:
            ua_binary.MAX_RESHAPE_ELEMENTS = min(_ASYNCUA_MAX_RESHAPE_ELEMENTS, int(max_array_length))
        if _installed:
            return
        ua_binary.variant_from_binary = _counted(ua_binary.variant_from_binary)
        ua_binary.extensionobject_from_binary = _counted(ua_binary.extensionobject_from_binary)
        original_dataclass = ua_binary._create_dataclass_deserializer

        @functools.cache
        def dataclass_deserializer(objtype):
            decode = original_dataclass(objtype)
            name = objtype if isinstance(objtype, str) else getattr(objtype, "__name__", "")
            return _counted(decode) if name in _COUNTED_STRUCTS else decode

        ua_binary._create_dataclass_deserializer = dataclass_deserializer
        # Every cached decoder built so far holds the unpatched functions: forget them.
        for creator in (original_dataclass, ua_binary._create_uatype_deserializer,
                        ua_binary._create_uatype_array_deserializer, ua_binary._create_type_deserializer,
                        ua_binary._create_list_deserializer):
            creator.cache_clear()
        _installed = True



# ---- the Call service's own encodings ----
# What every method call decodes and encodes, written out: byte for byte as asyncua's generic codec, without its walk
# over dataclass fields (profiled with bench/ua_overhead.py: the request header's decode was 11 us and the answer's
# encode 12 us of a call's ~400 us in the serve process; 8 and 6 us now). Anything unusual (diagnostics, a string
# table, an additional header in an answer) goes to asyncua's own codec; tests/test_call_codec.py compares both
# codecs over many shapes of request and answer. Nested structures in a request still go through ua_binary's module
# functions, so the nesting limit above applies.

_ARRAY, _DIMENSIONS = 0x80, 0x40  # a Variant's encoding mask: an array; with dimensions
_NUMPY_ARRAYS = {ua.VariantType.Float.value: "<f4", ua.VariantType.Double.value: "<f8"}
_HANDLE_DIAGNOSTICS = struct.Struct("<II")
_INT32 = struct.Struct("<i")
_UINT32 = struct.Struct("<I")
_NO_DIAGNOSTICS = b"\x00"  # a DiagnosticInfo with no field set
_EMPTY = _INT32.pack(0)  # an empty array
_NULL_EXTENSION = b"\x00\x00\x00"  # a null ExtensionObject: TwoByte NodeId 0, no body
_EMPTY_DIAGNOSTICS = ua.DiagnosticInfo()
_NULL_NODE = ua.NodeId()


# A NodeId's whole encoding in bytes, by its encoding byte (OPC 10000-6, 5.2.2.9): TwoByte, FourByte, Numeric, Guid;
# String (3) and ByteString (5) are 7 bytes and their length. Expanded NodeIds (bits 0x80 and 0x40) are not cached.
_NODEID_SIZES = {0: 2, 1: 4, 2: 7, 4: 19}
_NODEID_CACHE_SIZE = 1024  # distinct NodeIds remembered; the cache starts over when full (a client sending many)
_NODEID_CACHE_MAX_BYTES = 256  # longer encodings are decoded, not remembered
_nodeids: dict[bytes, ua.NodeId] = {}


def cached_nodeid_from_binary(body) -> ua.NodeId | ua.ExpandedNodeId:
    """nodeid_from_binary(body), answering a NodeId seen before with the same object, found by its bytes. Every call
    names the same few (the service's type, the session's token, the object and the method): decoding the four was
    14 us of a call's CPU in the serve process at 16 clients (profiled with bench/ua_overhead.py). Shared NodeIds are
    never changed: asyncua and the handlers only compare and hash them. Reads asyncua's Buffer directly (its _data
    and _cur_pos), so this module's version check covers it."""
    data, pos, left = body._data, body._cur_pos, body._size
    if left < 2:
        return nodeid_from_binary(body)  # asyncua raises NotEnoughData
    encoding = data[pos]
    size = _NODEID_SIZES.get(encoding)
    if size is None:
        if encoding not in (3, 5) or left < 7:
            return nodeid_from_binary(body)
        size = 7 + max(0, _INT32.unpack_from(data, pos + 3)[0])
    if size > left or size > _NODEID_CACHE_MAX_BYTES:
        return nodeid_from_binary(body)
    key = bytes(data[pos:pos + size])
    node = _nodeids.get(key)
    if node is None:
        node = nodeid_from_binary(body)
        if len(_nodeids) >= _NODEID_CACHE_SIZE:
            _nodeids.clear()
        _nodeids[key] = node
        return node
    body.skip(size)
    return node


def request_header_from_binary(body) -> ua.RequestHeader:
    """struct_from_binary(ua.RequestHeader, body)."""
    token = cached_nodeid_from_binary(body)
    timestamp = Primitives.DateTime.unpack(body)
    handle, diagnostics = _HANDLE_DIAGNOSTICS.unpack(body.read(8))
    audit_entry_id = Primitives.String.unpack(body)
    timeout = Primitives.UInt32.unpack(body)
    if body.copy(3).read(3) == _NULL_EXTENSION:  # what every client sends: asyncua answers ExtensionObject()
        body.skip(3)
        additional = ua.ExtensionObject()
    else:
        additional = ua_binary.extensionobject_from_binary(body)
    return ua.RequestHeader(AuthenticationToken=token, Timestamp=timestamp, RequestHandle=handle,
                            ReturnDiagnostics=diagnostics, AuditEntryId=audit_entry_id, TimeoutHint=timeout,
                            AdditionalHeader=additional)


def call_parameters_from_binary(body) -> ua.CallParameters:
    """A Call request's parameters, decoded as asyncua decodes them, except that a one-dimensional Float or Double
    array argument becomes a numpy array straight from the bytes: asyncua makes a list of Python floats (23 us for
    a TE sample of 1040) that the handler then turns into an array (22 us more), per call."""
    params = ua.CallParameters()
    for _ in range(Primitives.Int32.unpack(body)):
        item = ua.CallMethodRequest()
        item.ObjectId = cached_nodeid_from_binary(body)
        item.MethodId = cached_nodeid_from_binary(body)
        item.InputArguments = [_argument_from_binary(body) for _ in range(Primitives.Int32.unpack(body))]
        params.MethodsToCall.append(item)
    return params


def _argument_from_binary(body) -> ua.Variant:
    encoding = body.copy(1).read(1)[0]  # peeked: asyncua's decoder reads it again when it takes over
    dtype = _NUMPY_ARRAYS.get(encoding & 0x3F)
    if dtype is None or not encoding & _ARRAY or encoding & _DIMENSIONS:
        return ua_binary.variant_from_binary(body)
    body.read(1)
    length = Primitives.Int32.unpack(body)
    if length < 0:
        return ua.Variant(None, ua.VariantType(encoding & 0x3F), is_array=True)
    values = np.frombuffer(body.read(length * int(dtype[-1])), dtype=dtype).copy()
    return ua.Variant(values, ua.VariantType(encoding & 0x3F), is_array=True)


def response_to_binary(response) -> bytes:
    """struct_to_binary(response): a CallResponse written out, any other response by asyncua."""
    if type(response) is not ua.CallResponse or not _plain(response):
        return struct_to_binary(response)
    header = response.ResponseHeader
    parts = [nodeid_to_binary(response.TypeId), Primitives.DateTime.pack(header.Timestamp),
             _HANDLE_DIAGNOSTICS.pack(header.RequestHandle, header.ServiceResult.value), _NO_DIAGNOSTICS, _EMPTY,
             _NULL_EXTENSION, _INT32.pack(len(response.Results))]
    for result in response.Results:
        parts.append(_UINT32.pack(result.StatusCode.value))
        parts.append(_INT32.pack(len(result.InputArgumentResults)))
        parts.extend(_UINT32.pack(status.value) for status in result.InputArgumentResults)
        parts.append(_EMPTY)
        parts.append(_INT32.pack(len(result.OutputArguments)))
        parts.extend(ua_binary.variant_to_binary(value) for value in result.OutputArguments)
    parts.append(_EMPTY)
    return b"".join(parts)


def _plain(response: ua.CallResponse) -> bool:
    """No diagnostics, string table or additional header anywhere, every list a list (what our calls answer)."""
    header = response.ResponseHeader
    extra = header.AdditionalHeader
    if (header.StringTable != [] or response.DiagnosticInfos != [] or header.ServiceDiagnostics != _EMPTY_DIAGNOSTICS
            or extra.Body is not None or extra.TypeId != _NULL_NODE or not isinstance(response.Results, list)
            or header.Timestamp is None):
        return False
    return all(isinstance(r.InputArgumentResults, list) and r.InputArgumentDiagnosticInfos == []
               and isinstance(r.OutputArguments, list) for r in response.Results)
