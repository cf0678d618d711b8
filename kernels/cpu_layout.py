"""The CPU kernels' weight layout: GGUF block formats rearranged into panels of 16 output rows, with the file's own
numbers (nothing is requantized), and the reference dequantization of that layout (numpy).

Why this layout: the integer dot-product instructions (AVX-512 VNNI `vpdpbusd`, AVX-VNNI, AVX2 `maddubs` + `madd`,
and AMX's tile rows) multiply 4 consecutive unsigned bytes of one operand with 4 signed bytes of the other into
one int32 lane. So a vector holds 16 outputs x 4 consecutive inputs ("a group row": byte 4 o + i is input i of
output o), the activations' 4 bytes are broadcast to every lane, and each lane sums one output's products: no
horizontal sums, and the same bytes are an AMX B tile row. A 256-bit CPU takes a group row as two halves of 8
outputs.

A matrix (N, K) is `data` (panels, records, RB) uint8, panels = ceil(N / 16) (rows past N are zeros), one record per
super-block of SB inputs (32 for Q4_0 / Q4_1 / Q8_0, 256 for the K-quants). Within a record, each block of 32
inputs keeps its weights as group rows; 4-bit values are packed two to a byte: byte [j][4 o + i] holds input
4 j + i of output o in its low nibble and input 16 + 4 j + i in its high one (j = 0..3). Record layouts (offsets in
bytes, fp16 little-endian, `o` the 16 outputs):

  Q4_0, Q4_1  SB 32, RB 320:  q[4][64] nibbles | d fp16[o] | m fp16[o]        w = d q + m   (Q4_0: m = -8 d, exact)
  Q5_0, Q5_1  SB 32, RB 384:  Q4's record | qh[64]: byte [4 o + i] bit j = bit 4 of group j's value, bit 4 + j that
                               of group j + 4's (j = 0..3)                 w = d q + m   (Q5_0: m = -16 d, exact)
  Q8_0        SB 32, RB 544:  q[8][64] u8 = q + 128 (group j: inputs 4 j..4 j + 3) | d fp16[o]    w = d (u - 128)
  Q4_K        SB 256, RB 2368: q[8 blocks][4][64] | d fp16[o] | dmin fp16[o] | sc u8[8][o] | m u8[8][o]
                               w = (d sc_b) q - (dmin m_b)   (gguf's own order of operations)
  Q5_K        SB 256, RB 2880: Q4_K's record | qh[8][64]: byte [4 o + i] bit j = bit 4 of the low-nibble value of
                               group j, bit 4 + j that of the high-nibble value (j = 0..3)
  Q6_K        SB 256, RB 3360: q[8][4][64] low 4 bits | qh[8][2][64] (half h: 0 low-nibble values, 1 high; bits
                               2 j, 2 j + 1 = bits 4, 5 of group j's value) | d fp16[o] | sc i8[16][o]
                               w = (d sc_s) (q - 32), sc_s per 16 inputs: the low nibbles of block b are sub-block
                               2 b, the high ones 2 b + 1

Every value is the file's: d, m, dmin as fp16 bits, scales as the file's 6-bit / 8-bit integers, quants as they
were. `dequantize` computes each weight with the operations gguf's reference does, in float32, so the two agree
exactly (tested on random blocks of every type).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PANEL = 16  # output rows per panel
QK = 32  # inputs per block (the activations are quantized per block of 32)
QK_K = 256  # inputs per K-quant super-block


@dataclass(frozen=True)
class Format:
    name: str
    code: int  # the C kernels' format number (kernels/cpu/quant_layout.h)
    super_block: int  # SB: inputs per record
    record_bytes: int  # RB
    gguf_block_bytes: int  # bytes of one GGUF block (of super_block weights)
    fp16_offsets: tuple[int, ...]  # where a GGUF block's fp16 scales sit (d; m or dmin for the affine types)


FORMATS = {f.name: f for f in (
    Format("Q4_0", 0, QK, 320, 18, (0,)),
    Format("Q4_1", 1, QK, 320, 20, (0, 2)),
    Format("Q8_0", 2, QK, 544, 34, (0,)),
    Format("Q5_0", 6, QK, 384, 22, (0,)),
    Format("Q5_1", 7, QK, 384, 24, (0, 2)),
    Format("Q4_K", 3, QK_K, 2368, 144, (0, 2)),
    Format("Q5_K", 4, QK_K, 2880, 176, (0, 2)),
    Format("Q6_K", 5, QK_K, 3360, 210, (208,)),
)}


def bytes_per_weight(name: str) -> float:
    f = FORMATS[name]
    return f.record_bytes / (PANEL * f.super_block)


# ---- GGUF blocks -> integer parts -----------------------------------------------------------------------------

def _f16(raw: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) fp16 bits as uint16."""
    return np.ascontiguousarray(raw).view(np.uint16)[..., 0]


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> (sc, m), each (..., 8) uint8 (gguf's unpacking)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_blocks(rows: np.ndarray, name: str, n: int, k: int) -> dict[str, np.ndarray]:
    """The integer parts of a GGUF matrix (rows: (N, bytes per row) uint8): q (N, K) uint8 (Q8_0: + 128), and the
    format's scale fields, each (N, super-blocks[, per super-block])."""
    f = FORMATS[name]
    blocks = rows.reshape(n, k // f.super_block, f.gguf_block_bytes)
    if name in ("Q4_0", "Q4_1"):
        off = 2 if name == "Q4_0" else 4
        packed = blocks[..., off:off + 16]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # low nibbles are inputs 0..15 of the block
        d = _f16(blocks[..., 0:2])
        if name == "Q4_0":
            m = (-8.0 * d.view(np.float16).astype(np.float32)).astype(np.float16).view(np.uint16)
        else:
            m = _f16(blocks[..., 2:4])
        return {"q": q.reshape(n, k), "d": d, "m": m}
    if name in ("Q5_0", "Q5_1"):
        off = 2 if name == "Q5_0" else 4
        qh = np.ascontiguousarray(blocks[..., off:off + 4]).view(np.uint32)  # bit j: element j's 5th bit
        packed = blocks[..., off + 4:off + 20]
        low = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
        bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = low | (bits << 4)
        d = _f16(blocks[..., 0:2])
        if name == "Q5_0":
            m = (-16.0 * d.view(np.float16).astype(np.float32)).astype(np.float16).view(np.uint16)
        else:
            m = _f16(blocks[..., 2:4])
        return {"q": q.reshape(n, k), "d": d, "m": m}
    if name == "Q8_0":
        q = blocks[..., 2:34] ^ np.uint8(0x80)  # int8 -> uint8 q + 128
        return {"q": q.reshape(n, k), "d": _f16(blocks[..., 0:2])}
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = _k_scales(blocks[..., 4:16])
        if name == "Q4_K":
            qs = blocks[..., 16:144].reshape(n, -1, 4, 32)  # chunk c of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
            q = np.stack([qs & 0x0F, qs >> 4], axis=3)  # (n, sb, 4, 2, 32)
        else:
            qh = blocks[..., 16:48]  # (n, sb, 32): bit j of byte l is bit 4 of sub-block j's element l
            qs = blocks[..., 48:176].reshape(n, -1, 4, 32)
            low = np.stack([qs & 0x0F, qs >> 4], axis=3)  # (n, sb, 4, 2, 32)
            bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (n, sb, 8, 32)
            q = low | (bits.reshape(low.shape) << 4)
        return {"q": q.reshape(n, k), "d": d, "dmin": dmin, "sc": sc, "m": mn}
    if name == "Q6_K":
        ql = blocks[..., 0:128].reshape(n, -1, 2, 64)  # half h: bytes 64 h..: elements 128 h + 64 s + e (nibble s)
        qh = blocks[..., 128:192].reshape(n, -1, 2, 32)  # half h: element 128 h + 32 t + e in bits 2 t
        low = np.stack([ql & 0x0F, ql >> 4], axis=3)  # (n, sb, 2, 2, 64)
        high = (qh[..., None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # (n, sb, 2, 4, 32)
        q = low.reshape(n, -1, 256) | (high.reshape(n, -1, 256) << 4)
        sc = blocks[..., 192:208].view(np.int8)
        return {"q": q.reshape(n, k), "d": _f16(blocks[..., 208:210]), "sc": sc}
    raise ValueError(f"no kernel layout for GGUF type {name}")


# ---- integer parts -> panels ------------------------------------------------------------------------------------

def _pad_rows(a: np.ndarray, n_pad: int) -> np.ndarray:
    if a.shape[0] == n_pad:
        return a
    return np.concatenate([a, np.zeros((n_pad - a.shape[0], *a.shape[1:]), a.dtype)])


def _group_rows(q: np.ndarray, panels: int) -> np.ndarray:
    """q (Npad, K) -> (panels, blocks, 8 groups, 64) bytes: group j = inputs 4 j..4 j + 3, byte 4 o + i."""
    blocks = q.shape[1] // QK
    g = q.reshape(panels, PANEL, blocks, 8, 4).transpose(0, 2, 3, 1, 4)  # panel, block, group, o, i
    return g.reshape(panels, blocks, 8, 64)


def _nibbles(groups: np.ndarray) -> np.ndarray:
    """(..., 8, 64) values -> (..., 4, 64): group j low, group j + 4 high."""
    return (groups[..., :4, :] & 0x0F) | ((groups[..., 4:, :] & 0x0F) << 4)


def _per_panel(a: np.ndarray, panels: int) -> np.ndarray:
    """(Npad, records[, x]) -> (panels, records, [x,] 16): the 16 outputs last."""
    a = a.reshape(panels, PANEL, *a.shape[1:])
    return np.moveaxis(a, 1, -1)


def _fifth_bits(groups: np.ndarray) -> np.ndarray:
    """(..., 8, 64) values -> (..., 64): bit j of byte [4 o + i] = bit 4 of group j's value (j = 0..7)."""
    bit4 = ((groups >> 4) & 1).astype(np.uint16)
    weights = (1 << np.arange(8, dtype=np.uint16))[:, None]
    return (bit4 * weights).sum(axis=-2).astype(np.uint8)


def pack(parts: dict[str, np.ndarray], name: str, n: int, k: int) -> np.ndarray:
    """The integer parts (decode_blocks) as panels: (panels, records, RB) uint8."""
    f = FORMATS[name]
    panels = -(-n // PANEL)
    n_pad = panels * PANEL
    p = {key: _pad_rows(v, n_pad) for key, v in parts.items()}
    records = k // f.super_block
    groups = _group_rows(p["q"], panels)  # (P, blocks, 8, 64)
    as_bytes = lambda a: np.ascontiguousarray(a).view(np.uint8).reshape(panels, records, -1)  # noqa: E731
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        pieces = [_nibbles(groups), _per_panel(p["d"], panels), _per_panel(p["m"], panels)]
        if name in ("Q5_0", "Q5_1"):
            pieces.append(_fifth_bits(groups))
    elif name == "Q8_0":
        pieces = [groups, _per_panel(p["d"], panels)]
    else:
        per_rec = groups.reshape(panels, records, 8, 8, 64)  # panel, record, block, group, 64
        low4 = _nibbles(per_rec)
        if name in ("Q4_K", "Q5_K"):
            pieces = [low4, _per_panel(p["d"], panels), _per_panel(p["dmin"], panels), _per_panel(p["sc"], panels),
                      _per_panel(p["m"], panels)]
            if name == "Q5_K":
                pieces.append(_fifth_bits(per_rec))
        else:
            hi2 = (per_rec >> 4) & 3  # (P, R, block, 8, 64)
            shifts = (2 * np.arange(4, dtype=np.uint16))[:, None]
            qh = np.stack([(hi2[..., :4, :].astype(np.uint16) << shifts).sum(axis=-2),
                           (hi2[..., 4:, :].astype(np.uint16) << shifts).sum(axis=-2)], axis=-2).astype(np.uint8)
            pieces = [low4, qh, _per_panel(p["d"], panels), _per_panel(p["sc"], panels)]
    out = np.concatenate([as_bytes(x) for x in pieces], axis=-1)
    assert out.shape[-1] == f.record_bytes, (name, out.shape)
    return out


def from_gguf(raw: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    """A GGUF matrix's raw bytes (any shape holding N rows) in the kernel layout."""
    f = FORMATS[name]
    if k % f.super_block:
        raise ValueError(f"{name} matrix with {k} inputs: not a multiple of {f.super_block}")
    rows = np.ascontiguousarray(np.asarray(raw).reshape(-1).view(np.uint8)).reshape(n, -1)
    return pack(decode_blocks(rows, name, n, k), name, n, k)


# ---- panels -> float32 (the reference) --------------------------------------------------------------------------

def _take(data: np.ndarray, start: int, nbytes: int, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A field of every record: (P, R, *shape) of dtype."""
    raw = np.ascontiguousarray(data[:, :, start:start + nbytes])
    return raw.view(dtype).reshape(*data.shape[:2], *shape)


def _values(groups: np.ndarray) -> np.ndarray:
    """(P, blocks, 8, 64) per-group values -> (P*16, blocks*32): back to (output, input)."""
    p, blocks = groups.shape[:2]
    g = groups.reshape(p, blocks, 8, PANEL, 4).transpose(0, 3, 1, 2, 4)  # panel, o, block, group, i
    return g.reshape(p * PANEL, blocks * QK)


def _unnibble(packed: np.ndarray) -> np.ndarray:
    """(..., 4, 64) -> (..., 8, 64)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-2)


def _unfifth(qh: np.ndarray) -> np.ndarray:
    """(..., 1, 64) fifth-bit bytes -> (..., 8, 64) values 0 or 16 per group."""
    return ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4


def _outputs(a: np.ndarray) -> np.ndarray:
    """(P, R, [x,] 16) -> (P*16, R[, x])."""
    a = np.moveaxis(a, -1, 1)
    return a.reshape(a.shape[0] * PANEL, *a.shape[2:])


def dequantize(data: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    """float32 (N, K) weights of a matrix in the kernel layout, as gguf computes them from the file's blocks."""
    p, r = data.shape[:2]
    f32 = lambda bits: bits.view(np.float16).astype(np.float32)  # noqa: E731
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        groups = _unnibble(_take(data, 0, 256, np.uint8, (4, 64)))
        if name in ("Q5_0", "Q5_1"):
            groups = groups | _unfifth(_take(data, 320, 64, np.uint8, (1, 64)))
        q = _values(groups).astype(np.float32)
        d = _outputs(f32(_take(data, 256, 32, np.uint16, (16,))))
        m = _outputs(f32(_take(data, 288, 32, np.uint16, (16,))))
        w = np.repeat(d, QK, axis=1) * q + np.repeat(m, QK, axis=1)
    elif name == "Q8_0":
        q = _values(_take(data, 0, 512, np.uint8, (8, 64))).astype(np.float32) - 128.0
        d = _outputs(f32(_take(data, 512, 32, np.uint16, (16,))))
        w = q * np.repeat(d, QK, axis=1)
    elif name in ("Q4_K", "Q5_K"):
        low = _unnibble(_take(data, 0, 2048, np.uint8, (8, 4, 64)))  # (P, R, 8 blocks, 8, 64)
        if name == "Q5_K":
            low = low | _unfifth(_take(data, 2368, 512, np.uint8, (8, 1, 64)))
        q = _values(low.reshape(p, r * 8, 8, 64)).astype(np.float32)
        d = _outputs(f32(_take(data, 2048, 32, np.uint16, (16,))))  # (N, R)
        dmin = _outputs(f32(_take(data, 2080, 32, np.uint16, (16,))))
        sc = _outputs(_take(data, 2112, 128, np.uint8, (8, 16))).astype(np.float32)  # (N, R, 8)
        mn = _outputs(_take(data, 2240, 128, np.uint8, (8, 16))).astype(np.float32)
        dl = (d[..., None] * sc).reshape(p * PANEL, -1)  # gguf: d * sc, dmin * m, then d q - dm
        ml = (dmin[..., None] * mn).reshape(p * PANEL, -1)
        w = np.repeat(dl, QK, axis=1) * q - np.repeat(ml, QK, axis=1)
    elif name == "Q6_K":
        low = _unnibble(_take(data, 0, 2048, np.uint8, (8, 4, 64)))  # (P, R, 8, 8, 64)
        qh = _take(data, 2048, 1024, np.uint8, (8, 2, 64))
        hi = (qh[:, :, :, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # (P, R, 8, 2, 4, 64)
        q6 = low | (hi.reshape(p, r, 8, 8, 64) << 4)
        q = _values(q6.reshape(p, r * 8, 8, 64)).astype(np.int8) - np.int8(32)
        d = _outputs(f32(_take(data, 3072, 32, np.uint16, (16,))))  # (N, R)
        sc = _outputs(_take(data, 3104, 256, np.int8, (16, 16))).astype(np.float32)  # (N, R, 16)
        dl = (d[..., None] * sc).reshape(p * PANEL, -1)  # per 16 inputs
        w = np.repeat(dl, 16, axis=1) * q.astype(np.float32)
    else:
        raise ValueError(f"no kernel layout for GGUF type {name}")
    return np.ascontiguousarray(w[:n, :k], dtype=np.float32)


def unpack(data: np.ndarray, name: str, n: int, k: int) -> dict[str, np.ndarray]:
    """The integer parts of a matrix in the layout (the inverse of `pack`): to stack or reorder rows, then pack."""
    p, r = data.shape[:2]
    u16 = lambda start: _outputs(_take(data, start, 32, np.uint16, (16,)))[:n]  # noqa: E731
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        groups = _unnibble(_take(data, 0, 256, np.uint8, (4, 64)))
        if name in ("Q5_0", "Q5_1"):
            groups = groups | _unfifth(_take(data, 320, 64, np.uint8, (1, 64)))
        q = _values(groups)
        parts = {"d": u16(256), "m": u16(288)}
    elif name == "Q8_0":
        q = _values(_take(data, 0, 512, np.uint8, (8, 64)))
        parts = {"d": u16(512)}
    elif name in ("Q4_K", "Q5_K"):
        low = _unnibble(_take(data, 0, 2048, np.uint8, (8, 4, 64)))
        if name == "Q5_K":
            low = low | _unfifth(_take(data, 2368, 512, np.uint8, (8, 1, 64)))
        q = _values(low.reshape(p, r * 8, 8, 64))
        parts = {"d": u16(2048), "dmin": u16(2080), "sc": _outputs(_take(data, 2112, 128, np.uint8, (8, 16)))[:n],
                 "m": _outputs(_take(data, 2240, 128, np.uint8, (8, 16)))[:n]}
    elif name == "Q6_K":
        low = _unnibble(_take(data, 0, 2048, np.uint8, (8, 4, 64)))
        qh = _take(data, 2048, 1024, np.uint8, (8, 2, 64))
        hi = (qh[:, :, :, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        q = _values((low | (hi.reshape(p, r, 8, 8, 64) << 4)).reshape(p, r * 8, 8, 64))
        parts = {"d": u16(3072), "sc": _outputs(_take(data, 3104, 256, np.int8, (16, 16)))[:n]}
    else:
        raise ValueError(f"no kernel layout for GGUF type {name}")
    parts["q"] = q[:n, :k]
    return {key: np.ascontiguousarray(v) for key, v in parts.items()}


def int4_groups(data: np.ndarray, name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(q (N, K) uint8 0..15, scale (N, K / 32), zero (N, K / 32) float32) with w = (q - 8) scale + zero, for the
    4-bit types (torch's CPU int4 op and the Triton kernel take this form); None for the others."""
    if name in ("Q4_0", "Q4_1"):
        q = _values(_unnibble(_take(data, 0, 256, np.uint8, (4, 64))))
        d = _outputs(_take(data, 256, 32, np.uint16, (16,)).view(np.float16).astype(np.float32))
        m = _outputs(_take(data, 288, 32, np.uint16, (16,)).view(np.float16).astype(np.float32))
    elif name == "Q4_K":
        p, r = data.shape[:2]
        q = _values(_unnibble(_take(data, 0, 2048, np.uint8, (8, 4, 64))).reshape(p, r * 8, 8, 64))
        d = _outputs(_take(data, 2048, 32, np.uint16, (16,)).view(np.float16).astype(np.float32))
        dmin = _outputs(_take(data, 2080, 32, np.uint16, (16,)).view(np.float16).astype(np.float32))
        sc = _outputs(_take(data, 2112, 128, np.uint8, (8, 16))).astype(np.float32)
        mn = _outputs(_take(data, 2240, 128, np.uint8, (8, 16))).astype(np.float32)
        d, m = (d[..., None] * sc).reshape(p * PANEL, -1), -(dmin[..., None] * mn).reshape(p * PANEL, -1)
    else:
        return None
    return (np.ascontiguousarray(q[:n, :k]), np.ascontiguousarray(d[:n]),
            np.ascontiguousarray((m + 8.0 * d)[:n]))


def int8_blocks(data: np.ndarray, name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(q (N, K) int8, scale (N, K / 32) float32) with w = q scale, for Q8_0; None for the others."""
    if name != "Q8_0":
        return None
    q = (_values(_take(data, 0, 512, np.uint8, (8, 64))) ^ np.uint8(0x80)).view(np.int8)
    d = _outputs(_take(data, 512, 32, np.uint16, (16,)).view(np.float16).astype(np.float32))
    return np.ascontiguousarray(q[:n, :k]), np.ascontiguousarray(d[:n])


def panel_rows(data: np.ndarray, name: str, n: int, k: int, rows: np.ndarray) -> np.ndarray:
    """float32 (len(rows), K): the given output rows only (embedding lookups, the head's refinement)."""
    panels = np.unique(np.asarray(rows) // PANEL)
    sub = dequantize(data[panels], name, len(panels) * PANEL, k)
    where = {int(p): i for i, p in enumerate(panels)}
    idx = np.array([where[int(r) // PANEL] * PANEL + int(r) % PANEL for r in np.asarray(rows).reshape(-1)])
    return sub[idx] if len(idx) else np.zeros((0, k), np.float32)


def random_blocks(name: str, n: int, k: int, seed: int, scale: float = 0.02) -> np.ndarray:
    """n rows of random GGUF blocks of type `name` (tests and benchmarks): every byte random except the fp16 scales
    (finite, about `scale` in size; a random bit pattern would be inf or NaN)."""
    rng = np.random.default_rng(seed)
    f = FORMATS[name]
    nb = n * k // f.super_block
    raw = rng.integers(0, 256, size=(nb, f.gguf_block_bytes), dtype=np.uint8)
    for off in f.fp16_offsets:
        values = (rng.standard_normal(nb) * scale).astype(np.float16)
        raw[:, off:off + 2] = values.view(np.uint8).reshape(nb, 2)
    return raw.reshape(n, -1)


# ---- float matrices quantized with gguf's own quantizers -----------------------------------------------------

def quantize_float(w: np.ndarray, name: str) -> np.ndarray:
    """A float matrix (N, K) quantized to Q8_0 / Q4_0 / Q4_1 by gguf's reference quantizer, in the kernel layout."""
    import gguf

    n, k = w.shape
    if name not in ("Q8_0", "Q4_0", "Q4_1"):
        raise ValueError(f"quantizing float weights to {name} is not offered")
    raw = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType[name])
    return from_gguf(raw, name, n, k)
