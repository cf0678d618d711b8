"""Write this step's keys and values into their slots of the cache.

Cache layout (models/llama.py): kv[2, n_layers, n_slots, n_kv_heads, max_seq_len + 1, head_dim]; pass one layer's
views k_cache = kv[0, l], v_cache = kv[1, l], each (n_slots, n_kv_heads, T, head_dim).

    write_kv_(k_cache, v_cache, k, v, slot_ids, positions)

k, v: (N, n_kv_heads, head_dim) (views of a fused qkv are fine); slot_ids, positions: (N,) integer. Row i lands at
k_cache[slot_ids[i], :, positions[i]]. Padded tokens should point at the scratch position max_seq_len.
"""
from __future__ import annotations

import torch

from kernels.dispatch import next_pow2, use_triton


def write_kv_torch(k_cache, v_cache, k, v, slot_ids, positions) -> None:
    k_cache[slot_ids, :, positions] = k.to(k_cache.dtype)
    v_cache[slot_ids, :, positions] = v.to(v_cache.dtype)


def write_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_ids: torch.Tensor, positions: torch.Tensor, *, backend: str = "auto") -> None:
    if not use_triton(backend, k_cache.device):
        write_kv_torch(k_cache, v_cache, k, v, slot_ids, positions)
        return
    from kernels.triton_kv_write import write_kv_kernel

    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv: the head_dim of k, v and the caches must be contiguous")
    n, n_kv, hd = k.shape
    write_kv_kernel[(n,)](k_cache, v_cache, k, v, slot_ids, positions,
                          *k_cache.stride()[:3], *v_cache.stride()[:3], k.stride(0), k.stride(1),
                          v.stride(0), v.stride(1), n_kv, hd, BLOCK_H=next_pow2(n_kv), BLOCK_D=next_pow2(hd))
