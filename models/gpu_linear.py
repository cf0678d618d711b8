"""Quantized matrices (models/quant.py's formats) multiplied by the Triton kernel of kernels/dequant_matmul.py: on a
GPU, and on a CPU under the Triton interpreter (tests). The same numbers as the CPU kernels multiply, laid out for
the GPU here (int4 nibbles two per byte). A format without a Triton kernel is dequantised once (dense)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models import quant


class TritonQuantLinear:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int,
                 in_features: int):
        self.q, self.scale, self.zero, self.bits, self.group = q, scale, zero, bits, group
        self.out_features, self.in_features = q.shape[0], in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.dequant_matmul import group_matmul
        return group_matmul(x, self.q, self.scale, self.zero, bits=self.bits, group=self.group, backend="triton")


class DenseLinear:
    def __init__(self, w: torch.Tensor):
        self.w = w
        self.out_features, self.in_features = w.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w.to(x.dtype))


def gpu_linear(m, device: torch.device, dtype: torch.dtype):
    """The Triton linear of a quantized matrix on device; scales kept fp32 (the CPU kernels' numbers)."""
    from kernels.dequant_matmul import BLOCK, pack_int4
    if isinstance(m, quant.Int4Groups) and m.shape[1] % BLOCK == 0:
        return TritonQuantLinear(pack_int4(m.q).to(device), m.scale.float().contiguous().to(device),
                                 m.zero.float().contiguous().to(device), 4, quant.GROUP, m.shape[1])
    if isinstance(m, quant.Int8Rows) and m.shape[1] % BLOCK == 0:
        return TritonQuantLinear(m.q.contiguous().to(device), m.scale.float().reshape(-1, 1).to(device), None, 8,
                                 m.shape[1], m.shape[1])
    return DenseLinear(quant.dequantize(m).to(device, dtype))
