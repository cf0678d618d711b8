"""SiLU-gate multiply of the fused gate/up projection: (..., 2 * I) -> (..., I), silu(gate) * up in fp32, rounded
once to the input dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import use_triton

BLOCK = 1024


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    if gate_up.shape[-1] % 2:
        raise ValueError("silu_mul: the last dim must hold gate and up halves")
    if not use_triton(backend, gate_up.device):
        return silu_mul_torch(gate_up)
    from kernels.triton_activation import silu_mul_kernel

    import triton

    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(BLOCK, triton.next_power_of_2(width))
    silu_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](rows, out, width, rows.stride(0), out.stride(0),
                                                                BLOCK=block)
    return out.view(*gate_up.shape[:-1], width)
