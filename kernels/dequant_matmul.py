"""Weight-only int8 / int4 matmul for decode: y = x @ dequant(W)^T with W kept quantized in memory.

Format (symmetric, one fp16 scale per `group_size` = 32 inputs of each output row):
    int8: qweight int8  (out, in),       w = q * scale
    int4: qweight uint8 (out, in // 2),  byte j holds input 2j in its low nibble and 2j+1 in its high nibble,
          w = (nibble - 8) * scale
    scales: fp16 (out, in // group_size)

    qw = quantize_weight(w, bits=4)          # from a float (out, in) matrix
    y = dequant_matmul(x, qw)                # x: (..., in) fp16/bf16/fp32 -> (..., out) in x's dtype

The kernel reads the packed weights once per block of up to 16 rows of x (decode batches), dequantises in registers
and multiplies in the input dtype with fp32 accumulation. The twin dequantises to a dense matrix and calls F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.dispatch import dot_in_fp32, next_pow2, use_triton

GROUP_SIZE = 32


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    out_features: int
    in_features: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.bits == 8:
            q = self.qweight.float()
        else:
            packed = self.qweight.to(torch.int16)
            q = torch.stack([(packed & 15) - 8, (packed >> 4) - 8], dim=-1).reshape(self.out_features, -1).float()
        scale = self.scales.float().repeat_interleave(self.group_size, dim=1)
        return (q * scale).to(dtype)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        return QuantizedWeight(self.qweight.to(device), self.scales.to(device), self.bits, self.group_size,
                               self.out_features, self.in_features)


def quantize_weight(w: torch.Tensor, bits: int = 4, group_size: int = GROUP_SIZE) -> QuantizedWeight:
    if bits not in (4, 8):
        raise ValueError("quantize_weight: bits must be 4 or 8")
    out_f, in_f = w.shape
    if in_f % group_size or group_size % 2:
        raise ValueError(f"quantize_weight: in_features {in_f} must be a multiple of the group size {group_size}")
    groups = w.float().reshape(out_f, in_f // group_size, group_size)
    qmax = 127 if bits == 8 else 7
    scales = (groups.abs().amax(-1) / qmax).to(torch.float16)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # an all-zero group: any scale will do
    q = torch.round(groups / scales.float().unsqueeze(-1)).clamp(-qmax - (bits == 4), qmax).reshape(out_f, in_f)
    if bits == 8:
        qweight = q.to(torch.int8)
    else:
        nib = (q + 8).to(torch.uint8).reshape(out_f, in_f // 2, 2)
        qweight = nib[..., 0] | (nib[..., 1] << 4)
    return QuantizedWeight(qweight.contiguous(), scales.contiguous(), bits, group_size, out_f, in_f)


def dequant_matmul_torch(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return F.linear(x, qw.dequantize(x.dtype))


def dequant_matmul(x: torch.Tensor, qw: QuantizedWeight, *, backend: str = "auto") -> torch.Tensor:
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"dequant_matmul: x has {x.shape[-1]} inputs, the weight takes {qw.in_features}")
    if not use_triton(backend, x.device):
        return dequant_matmul_torch(x, qw)
    from kernels.triton_dequant_matmul import dequant_matmul_kernel

    import triton

    rows = x.reshape(-1, qw.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, qw.out_features, dtype=x.dtype, device=x.device)
    block_m = max(16, min(64, next_pow2(m)))
    block_n = 64
    block_k = max(qw.group_size, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(qw.out_features, block_n))
    dequant_matmul_kernel[grid](
        rows, qw.qweight, qw.scales, y, m, qw.out_features, qw.in_features,
        rows.stride(0), qw.qweight.stride(0), qw.scales.stride(0), y.stride(0),
        BITS=qw.bits, GROUP=qw.group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=dot_in_fp32(x.dtype))
    return y.view(*x.shape[:-1], qw.out_features)
