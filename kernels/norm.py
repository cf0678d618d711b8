"""RMSNorm, optionally fused with the residual add that precedes it in every Llama block.

    normed = add_rms_norm(delta, residual, weight, eps)   # residual += delta (in place); normed = rms(residual) * w
    normed = add_rms_norm(x, None, weight, eps)           # plain RMSNorm of x

Rounding follows HF's LlamaRMSNorm: the sum is kept in the model dtype, the statistics in fp32, the normalised value
is rounded to the model dtype before the weight multiplies it. x/residual: (..., hidden) with a contiguous last dim.
"""
from __future__ import annotations

import torch

from kernels.dispatch import next_pow2, use_triton


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 backend: str = "auto") -> torch.Tensor:
    if not use_triton(backend, x.device):
        return add_rms_norm_torch(x, residual, weight, eps)
    from kernels.triton_norm import add_rms_norm_kernel

    hidden = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError("add_rms_norm: residual must have x's shape and a contiguous last dim")
    rows = x.reshape(-1, hidden)
    res_rows = residual.view(-1, hidden) if residual is not None else rows  # a view: the kernel writes through it
    out = torch.empty_like(rows)
    add_rms_norm_kernel[(rows.shape[0],)](
        rows, res_rows, weight, out, hidden, rows.stride(0), res_rows.stride(0), out.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(hidden))
    return out.view(x.shape)
