"""A Llama decode step built only from the kernel ops: the proof that they compose into the model, and the
blueprint for wiring them into models/llama.py (same weight names, same cache layout).

    model = KernelLlama.from_hf_dir(path, dtype=torch.float16, device="cuda", backend="auto", quant_bits=None)
    kv = model.new_cache(n_slots, max_seq_len)               # kv[2, n_layers, n_slots, n_kv, max_seq_len + 1, hd]
    logits = model.decode_step(kv, token_ids, slot_ids, positions)   # (B,) each -> (B, vocab) fp32

Every row feeds one token at its own position (a prompt can be fed one token per step: prefill as decode), so rows
are ragged by construction. quant_bits=8/4 keeps the matrices quantized (kernels.dequant_matmul).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import (QuantizedWeight, add_rms_norm, apply_rotary_, decode_attention, dequant_matmul,
                     quantize_weight, rotary_tables, silu_mul, write_kv_)
from models.llama_config import LlamaConfig


class KernelLlama:
    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", backend: str = "auto", quant_bits: int | None = None,
                 max_positions: int = 4096):
        self.config, self.dtype, self.device, self.backend = config, dtype, torch.device(device), backend

        def take(name: str) -> torch.Tensor:
            return tensors[name].to(self.device, dtype).contiguous()

        def matrix(*names: str):
            w = torch.cat([tensors[n].float() for n in names]).contiguous()
            if quant_bits:
                return quantize_weight(w, quant_bits).to(self.device)
            return w.to(self.device, dtype)

        self.embed = take("model.embed_tokens.weight")
        head = "model.embed_tokens.weight" if config.tie_word_embeddings or "lm_head.weight" not in tensors \
            else "lm_head.weight"
        self.lm_head = matrix(head)
        self.final_norm = take("model.norm.weight")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "attn_norm": take(p + "input_layernorm.weight"),
                "qkv": matrix(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                "o": matrix(p + "self_attn.o_proj.weight"),
                "mlp_norm": take(p + "post_attention_layernorm.weight"),
                "gate_up": matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                "down": matrix(p + "mlp.down_proj.weight"),
            })
        self.cos, self.sin = rotary_tables(config.head_dim, max_positions, config.rope_theta, self.device)

    @classmethod
    def from_hf_dir(cls, path: str | Path, **kwargs) -> "KernelLlama":
        from safetensors.torch import load_file
        path = Path(path)
        config = LlamaConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        return cls(config, tensors, **kwargs)

    def new_cache(self, n_slots: int, max_seq_len: int) -> torch.Tensor:
        c = self.config
        return torch.zeros(2, c.num_hidden_layers, n_slots, c.num_key_value_heads, max_seq_len + 1, c.head_dim,
                           dtype=self.dtype, device=self.device)

    def _linear(self, x: torch.Tensor, w) -> torch.Tensor:
        if isinstance(w, QuantizedWeight):
            return dequant_matmul(x, w, backend=self.backend)
        return F.linear(x, w)

    @torch.no_grad()
    def decode_step(self, kv: torch.Tensor, token_ids: torch.Tensor, slot_ids: torch.Tensor,
                    positions: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """lengths: cache positions each row attends over, positions + 1 unless given (a padded row of a CUDA
        graph writes the scratch cell max_seq_len and attends over 1)."""
        c, be = self.config, self.backend
        n_h, n_kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        b = token_ids.shape[0]
        token_ids, slot_ids, positions = (t.to(self.device) for t in (token_ids, slot_ids, positions))
        lengths = positions + 1 if lengths is None else lengths.to(self.device)
        h = self.embed[token_ids]  # the residual stream, updated in place by add_rms_norm
        delta = None
        for li, lw in enumerate(self.layers):
            x = add_rms_norm(delta, h, lw["attn_norm"], c.rms_norm_eps, backend=be) if delta is not None \
                else add_rms_norm(h, None, lw["attn_norm"], c.rms_norm_eps, backend=be)
            qkv = self._linear(x, lw["qkv"]).view(b, n_h + 2 * n_kv, hd)
            q, k, v = qkv[:, :n_h], qkv[:, n_h:n_h + n_kv], qkv[:, n_h + n_kv:]
            apply_rotary_(q, k, positions, self.cos, self.sin, backend=be)
            write_kv_(kv[0, li], kv[1, li], k, v, slot_ids, positions, backend=be)
            attn = decode_attention(q, kv[0, li], kv[1, li], slot_ids, lengths, backend=be)
            delta = self._linear(attn.reshape(b, n_h * hd), lw["o"])
            x = add_rms_norm(delta, h, lw["mlp_norm"], c.rms_norm_eps, backend=be)
            delta = self._linear(silu_mul(self._linear(x, lw["gate_up"]), backend=be), lw["down"])
        x = add_rms_norm(delta, h, self.final_norm, c.rms_norm_eps, backend=be)
        return self._linear(x, self.lm_head).float()


def greedy(model: KernelLlama, prompts: list[list[int]], new_tokens: int, slots: list[int] | None = None,
           max_seq_len: int = 128) -> list[list[int]]:
    """Greedy continuations of several prompts decoded together, one token per row per step (prompts fed token by
    token, so rows of different lengths share every step). Returns the new tokens of each prompt."""
    slots = list(range(len(prompts))) if slots is None else slots
    kv = model.new_cache(max(slots) + 1, max_seq_len)
    seqs = [list(p) for p in prompts]
    produced: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(p) < new_tokens for p in produced):
        rows = [r for r in range(len(prompts)) if len(produced[r]) < new_tokens]
        tokens = torch.tensor([seqs[r][step] for r in rows])
        logits = model.decode_step(kv, tokens, torch.tensor([slots[r] for r in rows]),
                                   torch.full((len(rows),), step))
        for i, r in enumerate(rows):
            if step == len(seqs[r]) - 1:  # this row fed its last known token: its prediction is new
                nxt = int(logits[i].argmax())
                seqs[r].append(nxt)
                produced[r].append(nxt)
        step += 1
    return produced
