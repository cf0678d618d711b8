"""Weight-only int8 / int4 matmul with one scale, and optionally one zero point, per group of inputs:
y = x @ dequant(W)^T with W kept quantized in memory. The Triton side of models/quant.py's formats: the numbers are
those formats' own (GGUF Q4_0 / Q4_1 / Q8_0 blocks, per-row int8), laid out here for a GPU (models/gpu_linear.py
packs them at the move to the device); there is no weight type of this file's own.

    int4: q uint8 (N, K // 2); in each block of 32 inputs byte j holds input j (low nibble) and input j + 16 (high
          nibble), GGUF's order; w[n, k] = (nibble - 8) * scale[n, k // group] + zero[n, k // group]
    int8: q int8 (N, K); w[n, k] = q[n, k] * scale[n, k // group] (+ zero[n, k // group])
    scale, zero: (N, K // group) fp32 or fp16; zero None for symmetric formats. group: a multiple of 32 that
    divides K (32 for GGUF blocks; K for one scale per row).

    y = group_matmul(x, q, scale, zero, bits=4, group=32)     x (..., K) fp16/bf16/fp32 -> (..., N) in x's dtype

The kernel reads the packed weights once per block of up to 64 rows of x (decode batches), dequantises in registers
and multiplies in the input dtype with fp32 accumulation. The twin dequantises to a dense matrix and calls F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import dot_in_fp32, next_pow2, use_triton

BLOCK = 32  # inputs per int4 block (the nibble order repeats every 32 inputs)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15, one per byte -> (N, K // 2) uint8 in GGUF's order (see the module docstring)."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"pack_int4: K = {k} is not a multiple of {BLOCK}")
    blocks = q.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: (N, K) uint8 values 0..15."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // 16, 16)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(n, 2 * half)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense (N, K) weights."""
    values = q.float() if bits == 8 else unpack_int4(q).float() - 8.0
    w = values * scale.float().repeat_interleave(group, dim=1)
    if zero is not None:
        w = w + zero.float().repeat_interleave(group, dim=1)
    return w.to(dtype)


def _check(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
           group: int) -> tuple[int, int]:
    if bits not in (4, 8):
        raise ValueError("group_matmul: bits must be 4 or 8")
    n = q.shape[0]
    k = q.shape[1] * (2 if bits == 4 else 1)
    if x.shape[-1] != k:
        raise ValueError(f"group_matmul: x has {x.shape[-1]} inputs, the weight takes {k}")
    if group % BLOCK or k % group or scale.shape != (n, k // group):
        raise ValueError(f"group_matmul: group {group} must be a multiple of {BLOCK} dividing K = {k}, with "
                         f"scales of shape {(n, k // group)} (got {tuple(scale.shape)})")
    if zero is not None and zero.shape != scale.shape:
        raise ValueError("group_matmul: zero must have the scales' shape")
    return n, k


def group_matmul_torch(x, q, scale, zero, bits: int, group: int) -> torch.Tensor:
    return F.linear(x, dequantize(q, scale, zero, bits, group, x.dtype))


def group_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, *,
                 bits: int, group: int, backend: str = "auto") -> torch.Tensor:
    n, k = _check(x, q, scale, zero, bits, group)
    if not use_triton(backend, x.device):
        return group_matmul_torch(x, q, scale, zero, bits, group)
    from kernels.triton_dequant_matmul import dequant_matmul_kernel

    import triton

    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, min(64, next_pow2(m)))
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    z = zero if zero is not None else scale  # any pointer: HAS_ZERO=False never reads it
    dequant_matmul_kernel[grid](
        rows, q, scale, z, y, m, n, k, rows.stride(0), q.stride(0), scale.stride(0), z.stride(0), y.stride(0),
        BITS=bits, GROUP=group, HAS_ZERO=zero is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=dot_in_fp32(x.dtype))
    return y.view(*x.shape[:-1], n)
