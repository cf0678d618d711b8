"""The one forward pass of the Llama family over the slot KV cache: eager prefill and decode, prefill chunks and
decode rows in one pass (mixed), the compiled decode step (torch.export of this same function) and decode through
the fused Triton kernels (eagerly or captured as CUDA graphs) all run `forward()`.

What varies is passed in:
- the matmuls: each weight is a callable `w(x) -> y` (x (rows, in), y (rows, out)); the compiled step passes
  copies whose callables are ops a graph can hold (loader/compiled_decode.py), the rest the weights as built;
- the other ops: `ops` (models/forward_ops.py): TorchOps (plain torch: eager on any device, and what the compiler
  traces) or KernelOps (the fused Triton kernels of kernels/);
- the rows: one or more `Rows` parts (a block of B rows of S tokens each; mixed steps have a prefill part and a
  decode part), built by the ops' row builders. Every matmul multiplies the tokens of all parts at once (one pass
  over the weights); rotary, cache writes and attention run per part.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

Matmul = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Matmul  # (n_heads + 2 * n_kv_heads) * head_dim outputs: q, k, v
    qkv_bias: torch.Tensor | None  # qwen2
    qk_norm: torch.Tensor | None  # (n_heads + n_kv_heads, head_dim): qwen3's per-head RMSNorm weights of q and k
    o: Matmul
    mlp_norm: torch.Tensor
    gate_up: Matmul  # 2 * intermediate outputs: gate, up
    down: Matmul


@dataclass
class ModelWeights:
    """Everything the forward multiplies or looks up; built by models.llama.LlamaModel."""
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids -> hidden states in the compute dtype
    layers: list[LayerWeights]
    norm: torch.Tensor
    head: Matmul  # hidden -> logits
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float


@dataclass
class Rows:
    """One part of a step: B rows of up to S tokens each, each row in its own slot, flattened to N tokens in the
    forward: N = B * S (padded to the longest row), or, packed, only the rows' own tokens (attention that reads each
    token's slot and position, not a (B, S) block: our CPU kernels'). Which fields are set depends on the ops that
    built it (TorchOps: cos/sin/meta/last; KernelOps: lengths)."""
    b: int
    s: int
    token_ids: torch.Tensor  # (B, S), or (N,) packed
    slot_ids: torch.Tensor  # (B,)
    slot_rows: torch.Tensor  # (N,) each token's slot
    positions: torch.Tensor  # (N,) each token's position (padding repeats its row's last)
    write_pos: torch.Tensor  # (N,) each token's cache cell (padding: the scratch cell max_seq_len)
    cos: torch.Tensor | None = None  # (N, 1, head_dim) TorchOps' rotary, sin's first half negated
    sin: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # (B,) cache positions each row attends over (KernelOps)
    meta: Any = None  # TorchOps' attention mask and cache view (forward_ops.AttentionMeta); None when packed
    last: torch.Tensor | None = None  # (B,) each row's last token among the N (TorchOps' ragged rows)

    @property
    def n(self) -> int:
        return self.positions.shape[0]


def forward(w: ModelWeights, ops, k_layers: list[torch.Tensor], v_layers: list[torch.Tensor],
            parts: list[Rows]) -> torch.Tensor:
    """The final-normed hidden state of every token of every part, (sum of N, hidden), in part order; writes each
    token's keys and values into its slot's cache cell."""
    n_h, n_kv, hd = w.n_heads, w.n_kv_heads, w.head_dim
    sizes = [p.n for p in parts]
    h = torch.cat([w.embed(p.token_ids).reshape(n, -1) for p, n in zip(parts, sizes)]) if len(parts) > 1 \
        else w.embed(parts[0].token_ids).reshape(sizes[0], -1)
    delta = None
    for li, lw in enumerate(w.layers):
        h, x = ops.add_norm(h, delta, lw.attn_norm)
        qkv = lw.qkv(x)
        if lw.qkv_bias is not None:
            qkv = qkv + lw.qkv_bias
        qkv = qkv.view(-1, n_h + 2 * n_kv, hd)
        qk, v = qkv[:, :n_h + n_kv], qkv[:, n_h + n_kv:]
        if lw.qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), None, w.eps) * lw.qk_norm
        attn = []
        per_part = zip(parts, qk.split(sizes), v.split(sizes)) if len(parts) > 1 else ((parts[0], qk, v),)
        for part, qk_p, v_p in per_part:
            qk_p = ops.rotary(qk_p, part)
            ops.write_kv(k_layers[li], v_layers[li], qk_p[:, n_h:], v_p, part)
            attn.append(ops.attend(qk_p[:, :n_h], k_layers[li], v_layers[li], part))
        delta = lw.o(torch.cat(attn) if len(attn) > 1 else attn[0])
        h, x = ops.add_norm(h, delta, lw.mlp_norm)
        delta = lw.down(ops.silu_mul(lw.gate_up(x)))
    return ops.add_norm(h, delta, w.norm)[1]
