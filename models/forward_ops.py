"""The non-matmul ops of models/forward.py, in two sets with the same methods, and the rows each set reads:

- TorchOps: plain torch. Eager prefill, decode and mixed steps on any device; GraphOps, its variant traced by
  torch.export for the compiled decode step (loader/compiled_decode.py), whose rows come from `graph_decode_rows`
  (no host syncs) and whose decode attention is written for Inductor's fused loops.
- KernelOps: the fused Triton kernels of kernels/ (add+RMSNorm updating the residual in place, rotary in place,
  cache writes and decode attention that read each row's slot through its index and length, SiLU-gate): decode
  rows only, capturable as CUDA graphs (models/cuda_graphs.py). On a CPU only under the Triton interpreter (tests).

    add_norm(h, delta, weight) -> (h + delta, RMSNorm(h + delta) * weight)   delta None: (h, RMSNorm(h) * weight)
    rotary(qk, rows) -> qk rotated        qk (N, n_heads + n_kv_heads, head_dim)
    write_kv(k_cache, v_cache, k, v, rows)
    attend(q, k_cache, v_cache, rows) -> (N, n_heads * head_dim)
    silu_mul(gate_up) -> silu(gate) * up
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import add_rms_norm, apply_rotary_, decode_attention, silu_mul, write_kv_
from models.forward import Rows

ATTENTION_ROUND = 64  # attend over the longest row rounded up to this, never over all of max_seq_len


@dataclass
class AttentionMeta:
    """What every layer's attention over one part shares (built once per forward)."""
    t_len: int  # cache positions to look at: the longest row, rounded up (symbolic in the compiled step)
    first_slot: int | None  # rows are slots first..first+B-1: attend over a view of the cache, no gather
    mask: torch.Tensor  # (B, 1, S, t_len) bool, True where a query may look


def attention_length(longest: int, max_seq_len: int) -> int:
    return min(-(-longest // ATTENTION_ROUND) * ATTENTION_ROUND, max_seq_len)


class TorchOps:
    """attention: our CPU kernels' operator (kernels.cpu_quant.CpuKernels.attention: each query row over its slot's
    positions 0..position), or None for torch's sdpa. fused: our kernels (CpuKernels) for the residual add with
    RMSNorm and for SiLU-gate on float32 tensors, one pass each where torch makes several and allocates each
    intermediate (the eager forward's only: the compiled step leaves them to Inductor, which fuses them itself)."""

    def __init__(self, eps: float, attention=None, fused=None):
        self.eps, self.attention, self.fused = eps, attention, fused

    # -- rows ---------------------------------------------------------------------------------------------------
    def packs(self, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        """Ragged rows of this compute and cache dtype go packed: attention through our kernels takes each token as
        it is, so no padded token is multiplied (a 200-token prompt beside five 10-token ones: 250 rows, not 1,200)."""
        return self.attention is not None and dtype == torch.float32 and cache_dtype in (torch.float32,
                                                                                         torch.bfloat16)

    @staticmethod
    def ragged_rows(token_ids: torch.Tensor, slot_ids: torch.Tensor, start_pos: torch.Tensor,
                    seq_lens: torch.Tensor, max_seq_len: int, cos_t: torch.Tensor, sin_t: torch.Tensor,
                    packed: bool = False) -> Rows:
        """B ragged rows: row b holds seq_lens[b] >= 1 valid tokens at positions start_pos[b] + arange(S). Padded
        tokens write to the scratch cell; their queries see a harmless prefix (length >= 1, so no NaN). packed
        (`packs()`): the valid tokens only, row after row, for attention by our kernels (no mask, no cache view)."""
        dev = token_ids.device
        b, s = token_ids.shape
        offsets = torch.arange(s, device=dev)
        positions = start_pos.unsqueeze(1) + offsets  # (B, S)
        valid = offsets.unsqueeze(0) < seq_lens.unsqueeze(1)
        if packed:
            flat = positions[valid]
            return Rows(b, s, token_ids[valid], slot_ids, slot_ids.repeat_interleave(seq_lens), flat, flat,
                        cos=cos_t[flat].unsqueeze(1), sin=sin_t[flat].unsqueeze(1), last=seq_lens.cumsum(0) - 1)
        write_pos = torch.where(valid, positions, max_seq_len)
        query_pos = torch.minimum(positions, (start_pos + seq_lens - 1).unsqueeze(1))
        t_len = attention_length(int((start_pos + seq_lens).max()), max_seq_len)
        first = int(slot_ids[0])
        consecutive = bool(torch.equal(slot_ids, torch.arange(first, first + b, device=dev)))
        mask = (torch.arange(t_len, device=dev) <= query_pos.unsqueeze(-1)).unsqueeze(1)  # (B, 1, S, T)
        flat = query_pos.reshape(-1)
        return Rows(b, s, token_ids, slot_ids, slot_ids.repeat_interleave(s), flat, write_pos.reshape(-1),
                    cos=cos_t[flat].unsqueeze(1), sin=sin_t[flat].unsqueeze(1),
                    meta=AttentionMeta(t_len, first if consecutive else None, mask),
                    last=torch.arange(b, device=dev) * s + seq_lens - 1)

    @staticmethod
    def graph_decode_rows(token_ids: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                          mask: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor) -> Rows:
        """One token per row at positions (B,), attending where mask (B, 1, 1, T) says: built inside the compiled
        graph, so nothing here reads a tensor's value on the host (the caller chose T)."""
        b = token_ids.shape[0]
        return Rows(b, 1, token_ids.view(b, 1), slot_ids, slot_ids, positions, positions,
                    cos=cos_t[positions].unsqueeze(1), sin=sin_t[positions].unsqueeze(1),
                    meta=AttentionMeta(mask.shape[-1], None, mask))

    # -- ops ----------------------------------------------------------------------------------------------------
    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        if self.fused is not None and _fp32_rows(h, weight) and (delta is None or _fp32_rows(delta)):
            return h, self.fused.add_rms_norm(h, delta, weight, self.eps)  # h += delta, in place
        if delta is not None:
            h = h + delta
        return h, F.rms_norm(h, (h.shape[-1],), weight, self.eps)

    @staticmethod
    def rotary(qk: torch.Tensor, rows: Rows) -> torch.Tensor:
        # sin's first half is negated: rotate_half(x) * sin == swap_halves(x) * sin
        swapped = qk.unflatten(-1, (2, qk.shape[-1] // 2)).flip(-2).flatten(-2)
        return torch.addcmul(qk * rows.cos, swapped, rows.sin)

    @staticmethod
    def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> None:
        k_cache[rows.slot_rows, :, rows.write_pos] = k.to(k_cache.dtype)
        v_cache[rows.slot_rows, :, rows.write_pos] = v.to(v_cache.dtype)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Attention of the rows' queries over their slots (this step's keys and values already written): every
        token of every row through our kernels' operator where the ops have it (a prefill token is a query row at
        its own position, so the causal mask is its position; padding repeats its row's last), else sdpa (packed
        rows go to the kernel, which refuses tensors it does not take)."""
        if rows.meta is None or self.packs(q.dtype, k_cache.dtype):
            return self.attention(q, k_cache, v_cache, rows.slot_rows, rows.positions)
        return self.sdpa(q, k_cache, v_cache, rows)

    @staticmethod
    def sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: Rows) -> torch.Tensor:
        """torch's attention over the slots' cache views. GQA by folding the query heads of a group into the query
        rows, (B, n_kv, group * S, head_dim), instead of repeating keys and values; for decode (S == 1) that is a free
        view."""
        b, s, meta = rows.b, rows.s, rows.meta
        n_heads, hd = q.shape[1], q.shape[2]
        n_kv = k_cache.shape[1]
        group, t = n_heads // n_kv, meta.t_len
        if meta.first_slot is not None:
            keys = k_cache[meta.first_slot:meta.first_slot + b, :, :t]
            values = v_cache[meta.first_slot:meta.first_slot + b, :, :t]
        else:
            keys = k_cache[rows.slot_ids, :, :t]
            values = v_cache[rows.slot_ids, :, :t]
        if keys.dtype != q.dtype:  # a narrower cache (engine.kv_dtype): widened for this step's rows only
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if s == 1:
            out = F.scaled_dot_product_attention(q.view(b, n_kv, group, hd), keys, values, attn_mask=meta.mask)
            return out.reshape(b, n_heads * hd)
        qg = q.view(b, s, n_kv, group, hd).permute(0, 2, 3, 1, 4).reshape(b, n_kv, group * s, hd)
        mask = meta.mask.expand(b, group, s, t).reshape(b, 1, group * s, t)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
        return out.view(b, n_kv, group, s, hd).permute(0, 3, 1, 2, 4).reshape(b * s, n_heads * hd)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and _fp32_rows(gate_up):
            return self.fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _fp32_rows(*ts: torch.Tensor) -> bool:
    """float32 tensors on the CPU, contiguous (what the fused kernels take)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in ts)


class GraphOps(TorchOps):
    """TorchOps as the compiled decode step traces them (loader/compiled_decode.py). Decode attention is our CPU
    kernels' op where the step has them (kernels/cpu/quant_attention.h), else products and sums over the cache's
    rows, which Inductor fuses into loops that read the narrower cache where it lies: through sdpa, a step gathered
    and widened every row's keys and values into new tensors and then ran a kernel made for long queries (one layer,
    16 rows of SmolLM2 over 128 positions: 284 us; Inductor's loops 136 us)."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: Rows) -> torch.Tensor:
        if rows.s != 1 or self.packs(q.dtype, k_cache.dtype):
            return super().attend(q, k_cache, v_cache, rows)
        b, meta = rows.b, rows.meta
        n_heads, hd = q.shape[1], q.shape[2]
        n_kv = k_cache.shape[1]
        group, t = n_heads // n_kv, meta.t_len
        keys = k_cache[rows.slot_ids, :, :t].unsqueeze(2)  # (B, n_kv, 1, T, hd): read inside the fused loops
        values = v_cache[rows.slot_ids, :, :t].unsqueeze(2)
        queries = q.view(b, n_kv, group, 1, hd) * hd ** -0.5
        scores = (queries * keys.to(q.dtype)).sum(-1)  # (B, n_kv, group, T)
        weights = torch.softmax(scores.masked_fill(~meta.mask, float("-inf")), dim=-1)
        return (weights.unsqueeze(-1) * values.to(q.dtype)).sum(-2).reshape(b, n_heads * hd)

class KernelOps:
    """The fused Triton kernels; rows of one token each (decode)."""

    def __init__(self, eps: float, n_heads: int, cos_half: torch.Tensor, sin_half: torch.Tensor,
                 backend: str = "triton"):
        self.eps, self.n_heads, self.backend = eps, n_heads, backend
        self.cos, self.sin = cos_half, sin_half  # (positions, head_dim // 2) fp32, from models.rope.angle_tables

    @staticmethod
    def decode_rows(token_ids: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                    lengths: torch.Tensor) -> Rows:
        """One token per row at positions (B,); lengths: cache positions each row attends over (positions + 1;
        a padded row of a CUDA graph writes the scratch cell max_seq_len and attends over 1). No host syncs."""
        b = token_ids.shape[0]
        return Rows(b, 1, token_ids.view(b, 1), slot_ids, slot_ids, positions, positions, lengths=lengths)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        if delta is None:
            return h, add_rms_norm(h, None, weight, self.eps, backend=self.backend)
        return h, add_rms_norm(delta, h, weight, self.eps, backend=self.backend)  # h += delta, in place

    def rotary(self, qk: torch.Tensor, rows: Rows) -> torch.Tensor:
        apply_rotary_(qk[:, :self.n_heads], qk[:, self.n_heads:], rows.positions, self.cos, self.sin,
                      backend=self.backend)
        return qk

    def write_kv(self, k_cache, v_cache, k, v, rows: Rows) -> None:
        write_kv_(k_cache, v_cache, k, v, rows.slot_ids, rows.write_pos, backend=self.backend)

    def attend(self, q, k_cache, v_cache, rows: Rows) -> torch.Tensor:
        out = decode_attention(q, k_cache, v_cache, rows.slot_ids, rows.lengths, backend=self.backend)
        return out.reshape(rows.b, -1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up, backend=self.backend)
