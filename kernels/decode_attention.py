"""Decode attention straight from the slot cache: one new query per row, grouped-query heads, no gather copy.

    out = decode_attention(q, k_cache, v_cache, slot_ids, lengths)

q: (B, n_heads, head_dim) already rotated; k_cache/v_cache: one layer's (n_slots, n_kv_heads, T, head_dim) with this
step's keys/values already written; slot_ids: (B,) the slot of each row (any order, any subset); lengths: (B,) how
many cache positions row b attends over (its position + 1). Returns (B, n_heads, head_dim) in q's dtype.

The Triton path is split-K ("flash decoding"): each program takes one (row, kv head, split of `split_len`
positions) and all query heads of that kv head's group as the rows of a tl.dot (padded to 16), so K and V are read
once per group; a second kernel merges the splits by their log-sum-exp. The grid depends only on the cache shape,
not on the lengths, so the launch can be captured in a CUDA graph.
"""
from __future__ import annotations

import math

import torch

from kernels.dispatch import dot_in_fp32, next_pow2, use_triton

SPLIT_LEN = 256  # cache positions per program; T / SPLIT_LEN programs per (row, kv head)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                           lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    b, n_heads, hd = q.shape
    n_kv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    t = max(int(lengths.max()), 1)
    keys = k_cache[slot_ids, :, :t].float()  # (B, n_kv, t, hd): the twin gathers; the kernel does not
    values = v_cache[slot_ids, :, :t].float()
    qg = q.float().view(b, n_kv, n_heads // n_kv, hd)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # (B, n_kv, group, t)
    valid = torch.arange(t, device=q.device) < lengths.to(q.device).view(b, 1, 1, 1)
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)  # length 0 -> zeros
    return torch.matmul(probs, values).view(b, n_heads, hd).to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                     lengths: torch.Tensor, scale: float | None = None, *, backend: str = "auto",
                     split_len: int = SPLIT_LEN) -> torch.Tensor:
    b, n_heads, hd = q.shape
    n_slots, n_kv, t_cap, _ = k_cache.shape
    if n_heads % n_kv:
        raise ValueError("decode_attention: n_heads must be a multiple of n_kv_heads")
    if not use_triton(backend, q.device):
        return decode_attention_torch(q, k_cache, v_cache, slot_ids, lengths, scale)
    from kernels.triton_decode_attention import decode_attention_merge_kernel, decode_attention_split_kernel

    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("decode_attention: head_dim must be contiguous in q and the caches")
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    group = n_heads // n_kv
    split_len = next_pow2(min(split_len, max(t_cap, 16)))
    # fp32 tiles at 64 positions need 144 KB of shared memory at head_dim 128 (compiled for sm_90): halve them
    block_t = min(32 if q.dtype == torch.float32 else 64, split_len)
    n_splits = -(-t_cap // split_len)
    part_out = torch.empty(b, n_heads, n_splits, hd, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, n_heads, n_splits, dtype=torch.float32, device=q.device)
    decode_attention_split_kernel[(b, n_kv, n_splits)](
        q, k_cache, v_cache, slot_ids, lengths, part_out, part_lse,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        scale * 1.4426950408889634, group, hd, split_len,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_T=block_t, BLOCK_D=max(16, next_pow2(hd)),
        DOT_FP32=dot_in_fp32(q.dtype))
    out = torch.empty(b, n_heads, hd, dtype=q.dtype, device=q.device)
    decode_attention_merge_kernel[(b, n_heads)](
        part_out, part_lse, out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), n_splits, hd,
        BLOCK_S=next_pow2(n_splits), BLOCK_D=next_pow2(hd))
    return out
