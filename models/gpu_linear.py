"""Quantized matrices (models/quant.py's BlockMatrix, the one weight type of every block format) multiplied by the
Triton kernel of kernels/dequant_matmul.py: on a GPU, and on a CPU under the Triton interpreter (tests). The same
numbers the CPU kernels multiply, in the form the Triton kernel reads (4-bit types as nibbles two per byte with a
scale and zero per 32 inputs, Q8_0 as int8 with a scale per 32 inputs). Block types without a Triton kernel yet
(Q5_K, Q6_K) are dequantised once, dense."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models import quant


class TritonQuantLinear:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int,
                 in_features: int, backend: str = "auto"):
        self.q, self.scale, self.zero, self.bits, self.group = q, scale, zero, bits, group
        self.out_features, self.in_features = q.shape[0], in_features
        self.backend = backend  # kernels.dispatch: auto (Triton on CUDA, its twin elsewhere) | triton | torch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.dequant_matmul import group_matmul
        return group_matmul(x, self.q, self.scale, self.zero, bits=self.bits, group=self.group,
                            backend=self.backend)


class DenseLinear:
    def __init__(self, w: torch.Tensor):
        self.w = w
        self.out_features, self.in_features = w.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w.to(x.dtype))


def gpu_linear(m: quant.BlockMatrix, device: torch.device, dtype: torch.dtype, backend: str = "auto"):
    """The Triton linear of a quantized matrix on device; scales kept fp32 (the CPU kernels' numbers)."""
    from kernels.dequant_matmul import BLOCK, pack_int4
    k = m.shape[1]
    groups = m.int4_groups() if k % BLOCK == 0 else None
    if groups is not None:
        q, scale, zero = groups
        return TritonQuantLinear(pack_int4(q).to(device), scale.float().contiguous().to(device),
                                 zero.float().contiguous().to(device), 4, quant.GROUP, k, backend)
    blocks = m.int8_blocks() if k % BLOCK == 0 else None
    if blocks is not None:
        q, scale = blocks
        return TritonQuantLinear(q.contiguous().to(device), scale.float().contiguous().to(device), None, 8,
                                 quant.GROUP, k, backend)
    return DenseLinear(quant.dequantize(m).to(device, dtype))
