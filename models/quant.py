"""Weights kept quantized in memory: int8 rows and int4 groups, and the linear layers that multiply by them.

Two formats (`engine.weights`):
- int8: w[n, k] ~= q[n, k] * scale[n] (one scale per output row), multiplied weight-only by
  `torch._weight_int8pack_mm` (fp32 activations). Activations quantized too were tried and refused on accuracy:
  fbgemm's dynamic linear (`quantized::linear_dynamic`, one op, 2-3x faster than fp32 here) quantizes a whole batch
  per tensor, and must use 7-bit activations (its int16 pair sums overflow otherwise); over 600 teacher-forced tokens
  of SmolLM2 its top-1 agreement with the fp32 path was 38%, against 94% weight-only. `torch._int_mm` with a per-row
  quantizer written in Python was 4-10x slower than fp32 (several ops per call; a transposed int8 operand is slow).
- int4: w[n, k] ~= (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32], torch's CPU int4 layout
  (`_weight_int4pack_mm_for_cpu`, group 32). GGUF Q4_0 / Q4_1 blocks map onto it exactly (Q4_1: scale d, zero
  m + 8 d; Q4_0: scale d, zero 0), so an int4 model computes with the file's own numbers.

Quantizing from GGUF blocks never dequantises a whole matrix: rows are dequantised a chunk at a time into a small
float buffer and quantized again (int8), or the blocks' nibbles are taken as they are (int4 from Q4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

GROUP = 32  # int4 group size: GGUF's block size, and one of torch's int4 op's sizes
ROW_CHUNK = 256  # rows dequantised at a time when requantizing (a 256 x 1536 fp32 buffer is 1.5 MB)
FORMATS = ("int8", "int4")
# The token embeddings and lm_head stay bfloat16 in the quantized formats: their GGUF type is usually Q8_0 (a scale
# per 32 values), and requantizing them to one scale per row cost SmolLM2 4 points of top-1 agreement with the fp32
# path over 600 teacher-forced tokens (96%, with every other matrix exact int4); Q8_0 -> bfloat16 loses nothing
# that matters. 49,152 x 576 in bfloat16 is 57 MB.
HEAD_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class Int8Rows:
    """w[n, k] ~= q[n, k] * scale[n]."""
    q: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N,) float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


@dataclass
class Int4Groups:
    """w[n, k] ~= (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]; q holds values 0..15, one per byte."""
    q: torch.Tensor  # (N, K) uint8
    scale: torch.Tensor  # (N, K // 32) float32
    zero: torch.Tensor  # (N, K // 32) float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


QuantizedMatrix = Int8Rows | Int4Groups


# ---- quantizing ------------------------------------------------------------------------------------------------

def int8_rows(chunks: Iterator[torch.Tensor]) -> Int8Rows:
    """Symmetric int8 per output row from float row chunks (each (rows, K))."""
    qs, scales = [], []
    for w in chunks:
        w = w.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        qs.append(torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        scales.append(scale)
    return Int8Rows(torch.cat(qs), torch.cat(scales))


def int4_groups(chunks: Iterator[torch.Tensor]) -> Int4Groups:
    """Asymmetric int4 per group of 32 along K from float row chunks: the group's range split in 15 steps."""
    qs, scales, zeros = [], [], []
    for w in chunks:
        w = w.float()
        n, k = w.shape
        g = w.view(n, k // GROUP, GROUP)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = ((hi - lo) / 15.0).clamp_min(1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        qs.append(q.to(torch.uint8).view(n, k))
        scales.append(scale)
        zeros.append(lo + 8.0 * scale)  # (q - 8) * scale + zero == q * scale + lo
    return Int4Groups(torch.cat(qs), torch.cat(scales), torch.cat(zeros))


def float_chunks(w: torch.Tensor, rows: int = ROW_CHUNK) -> Iterator[torch.Tensor]:
    for i in range(0, w.shape[0], rows):
        yield w[i:i + rows]


def quantize(w: torch.Tensor, fmt: str) -> QuantizedMatrix:
    """A float matrix (e.g. from an HF safetensors file) quantized at load, a row chunk at a time."""
    if fmt == "int4" and w.shape[1] % GROUP == 0:
        return int4_groups(float_chunks(w))
    return int8_rows(float_chunks(w))


def concat_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Matrices stacked along the output rows (fused qkv, gate/up)."""
    if all(isinstance(p, Int8Rows) for p in parts):
        return Int8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    if all(isinstance(p, Int4Groups) for p in parts):
        return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))
    raise ValueError("cannot fuse matrices of different formats")


def permute_rows(m: QuantizedMatrix, index: torch.Tensor) -> QuantizedMatrix:
    if isinstance(m, Int8Rows):
        return Int8Rows(m.q[index].contiguous(), m.scale[index].contiguous())
    return Int4Groups(m.q[index].contiguous(), m.scale[index].contiguous(), m.zero[index].contiguous())


def dequantize(m: QuantizedMatrix) -> torch.Tensor:
    """float32 weights (tests and oracles only: serving never makes this copy)."""
    if isinstance(m, Int8Rows):
        return m.q.float() * m.scale[:, None]
    n, k = m.shape
    s = m.scale.repeat_interleave(GROUP, dim=1)
    z = m.zero.repeat_interleave(GROUP, dim=1)
    return (m.q.float() - 8.0) * s + z


# ---- from GGUF blocks ------------------------------------------------------------------------------------------

def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int], fmt: str,
                     dequantize_blocks) -> QuantizedMatrix:
    """A GGUF Q8_0 / Q4_0 / Q4_1 matrix in our format. `dequantize_blocks(raw_rows, type_name)` -> (n_blocks, 32)
    float32 is the loader's block decoder, used a row chunk at a time."""
    n, k = shape
    rows = np.asarray(raw).reshape(n, -1).view(np.uint8)  # (N, bytes per row): blocks never cross rows
    if fmt == "int4" and type_name in ("Q4_0", "Q4_1"):
        return _int4_from_q4(rows, type_name, n, k)

    def chunks() -> Iterator[torch.Tensor]:
        for i in range(0, n, ROW_CHUNK):
            part = rows[i:i + ROW_CHUNK]
            yield torch.from_numpy(dequantize_blocks(part, type_name)).view(part.shape[0], k)

    return int4_groups(chunks()) if fmt == "int4" else int8_rows(chunks())


def _int4_from_q4(rows: np.ndarray, type_name: str, n: int, k: int) -> Int4Groups:
    """Q4_0 / Q4_1 blocks taken as they are: nibbles 0..15, the block's scale d and (Q4_1) minimum m."""
    block_bytes = 18 if type_name == "Q4_0" else 20
    blocks = rows.reshape(n, k // GROUP, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 2:18] if type_name == "Q4_0" else blocks[..., 4:20]
    q = np.empty((n, k // GROUP, GROUP), np.uint8)
    q[..., :16] = packed & 0x0F  # low nibbles are elements 0..15 of the block
    q[..., 16:] = packed >> 4
    if type_name == "Q4_0":  # w = d * (q - 8)
        zero = np.zeros_like(d)
    else:  # w = d * q + m = (q - 8) * d + (m + 8 d)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d
    return Int4Groups(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d), torch.from_numpy(zero))


# ---- multiplying -----------------------------------------------------------------------------------------------

class Int8Linear:
    """y = x @ w.T for int8 rows, weight-only (fp32 activations): torch's `_weight_int8pack_mm`, or with `cpu_kernels`
    (kernels.cpu_quant, AVX2 CPUs) our kernel."""

    def __init__(self, m: Int8Rows, cpu_kernels=None):
        self.out_features, self.in_features = m.shape
        self.kernels = cpu_kernels if self.in_features % GROUP == 0 else None
        if self.kernels is not None:
            from kernels.cpu_quant import pack_int8
            self.panels, self.scale = pack_int8(m.q, m.scale)
        else:
            self.q, self.scale = m.q.contiguous(), m.scale.float().contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        if self.kernels is not None:
            from kernels.cpu_quant import q8_linear
            y = q8_linear(self.kernels, x2, self.panels, self.scale, self.out_features)
        else:
            y = torch._weight_int8pack_mm(x2, self.q, self.scale)
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], self.out_features)


class Int4Linear:
    """y = x @ w.T for int4 groups of 32 (fp32 activations): torch's CPU int4 op, or with `cpu_kernels`
    (kernels.cpu_quant, AVX2 CPUs) our kernel on panels of 8 rows with the blocks' own numbers."""

    def __init__(self, m: Int4Groups, cpu_kernels=None):
        self.out_features, self.in_features = m.shape
        self.kernels = cpu_kernels
        if cpu_kernels is not None:
            from kernels.cpu_quant import pack_int4
            self.panels = pack_int4(m.q, m.scale, m.zero)
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(m.q.to(torch.int32).contiguous(), 1)
            self.scales_and_zeros = torch.stack([m.scale.t(), m.zero.t()], dim=-1).float().contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float().contiguous()  # both ops want a contiguous fp32 input
        if self.kernels is not None:
            from kernels.cpu_quant import q4_linear
            y = q4_linear(self.kernels, x2, self.panels, self.out_features)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_and_zeros)
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], self.out_features)


def linear_for(m: QuantizedMatrix, cpu_kernels=None):
    """The linear layer for a quantized matrix; cpu_kernels: kernels.cpu_quant.library() or None for torch's ops."""
    return Int8Linear(m, cpu_kernels) if isinstance(m, Int8Rows) else Int4Linear(m, cpu_kernels)
