"""The payload digest of audit records: what a call's input and output were, without storing them."""
from __future__ import annotations

import hashlib

import numpy as np


def digest(data: bytes | str | list[float] | np.ndarray) -> str:
    """"sha256:<hex of the first 16 bytes>" of a canonical encoding: a type tag, then the bytes, the UTF-8 text,
    or the values as little-endian float64 (so a list and an array of the same numbers digest alike)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        tag, body = b"bytes\0", data
    elif isinstance(data, str):
        tag, body = b"str\0", data.encode("utf-8", "surrogatepass")
    else:
        body = np.ascontiguousarray(data, dtype="<f8").ravel()
        if np.isnan(body).any():
            body = np.where(np.isnan(body), np.nan, body)  # one NaN bit pattern
        tag = b"f64\0"
    hashed = hashlib.sha256(tag)
    hashed.update(body)
    return "sha256:" + hashed.hexdigest()[:32]


class DigestOf:
    """digest(data), computed when str() of it is asked for: when the call is accounted, after its answer went out,
    not while the caller waits. `data` must not change after: an array from the network or the engine."""
    __slots__ = ("data",)

    def __init__(self, data: bytes | str | list[float] | np.ndarray):
        self.data = data

    def __str__(self) -> str:
        return digest(self.data)

