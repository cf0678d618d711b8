"""A bound on how deeply a received message may nest Variants, ExtensionObjects, DataValues and DiagnosticInfos.

asyncua decodes those recursively (ua_binary.variant_from_binary -> unpack_uatype -> extensionobject_from_binary ->
struct decoders -> variant_from_binary ...; DiagnosticInfo holds an InnerDiagnosticInfo), so a crafted message of a
few kilobytes could drive the decoder as deep as Python's recursion limit allows. No method of the appliance takes
anything but scalars and one-dimensional arrays of built-in types, and no service needs more than a few levels.

`install_nesting_limit(depth)` patches asyncua's binary decoder FOR THE WHOLE PROCESS (clients in the same process
included): each of those decoders counts its depth in a contextvar and raises NestingTooDeep (BadDecodingError)
past the limit. The server calls it once at start; calling it again only changes the limit. The decoders asyncua
builds are cached closures that captured the original functions, so the caches are cleared once after patching.
"""
from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable

from asyncua import ua
from asyncua.ua import ua_binary
from asyncua.ua.uaerrors import BadDecodingError

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


def nested_variant(depth: int, leaf: ua.Variant | None = None) -> ua.Variant:
    """A Variant nesting `depth` Variants (a one-element Variant array per level); for tests and documentation."""
    v = leaf if leaf is not None else ua.Variant(1.0, ua.VariantType.Float)
    for _ in range(depth - 1):
        v = ua.Variant([v], ua.VariantType.Variant)
    return v
