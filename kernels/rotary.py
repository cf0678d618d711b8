"""Rotary position embedding applied in place to q and k (rotate-half / NeoX layout, as HF Llama).

    cos, sin = rotary_tables(head_dim, max_positions, theta, device)     # (max_positions, head_dim // 2) fp32
    apply_rotary_(q, k, positions, cos, sin)

q: (N, n_heads, head_dim), k: (N, n_kv_heads, head_dim): views are fine (e.g. slices of a fused qkv output) as long
as the last dim is contiguous. positions: (N,) integer. The rotation is computed in fp32 and rounded once.
"""
from __future__ import annotations

import torch

from kernels.dispatch import next_pow2, use_triton


def rotary_tables(head_dim: int, max_positions: int, theta: float,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of position * inv_freq in fp32, exactly as HF's LlamaRotaryEmbedding forms them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return freqs.cos().to(device), freqs.sin().to(device)


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def apply_rotary_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> None:
    c = cos[positions].unsqueeze(1)  # (N, 1, half)
    s = sin[positions].unsqueeze(1)
    _rotate_torch(q, c, s)
    _rotate_torch(k, c, s)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  *, backend: str = "auto") -> None:
    if q.shape[-1] % 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError("rotary: q and k need the same even head_dim")
    if not use_triton(backend, q.device):
        apply_rotary_torch(q, k, positions, cos, sin)
        return
    from kernels.triton_rotary import rotary_kernel

    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("rotary: the last dim of q, k, cos and sin must be contiguous")
    n, n_q, hd = q.shape
    n_k = k.shape[1]
    rotary_kernel[(n,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                        cos.stride(0), n_q, n_k, hd // 2, BLOCK_HQ=next_pow2(n_q), BLOCK_HK=next_pow2(n_k),
                        BLOCK_HALF=next_pow2(hd // 2))
