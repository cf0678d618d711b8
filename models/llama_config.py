"""The settings of the Llama-family architectures the engine runs, read from an HF `config.json` dict or from GGUF
metadata (models/gguf_loader.py), in one place; and the tensors each architecture has.

Architectures (HF `model_type` / GGUF `general.architecture`), all decoder-only with RMSNorm, SiLU-gated MLP, GQA
and rotary positions over the two halves of each head:
- llama: the reference.
- qwen2 (Qwen2.5): biases on the q, k and v projections.
- qwen3: RMSNorm over each head of q and k (weights `self_attn.q_norm` / `k_norm`), head_dim set on its own.
- phi3 (Phi-3, Phi-3.5): q/k/v in one matrix (`self_attn.qkv_proj`) and gate/up in one (`mlp.gate_up_proj`),
  "longrope" rotary scaling.
Rotary scaling (`rope_scaling`, see models/rope.py): none, "linear", "llama3" (Llama 3.1 / 3.2), "longrope", or
llama.cpp's per-frequency divisors ("freq_factors", what a Llama 3 GGUF stores as `rope_freqs.weight`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"
    # None, or {"rope_type": one of ROPE_TYPES, ...its parameters}; longrope's attention_factor already resolved
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model config: {name} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model config: num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("model config: head_dim must be even (rotary positions rotate pairs)")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"model architecture {self.architecture!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in ROPE_TYPES:
                raise ValueError(f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
            if kind == "default":
                self.rope_scaling = None

    # ---- what the architecture has ------------------------------------------------------------------------
    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def fused_projections(self) -> bool:
        """q/k/v stored as one matrix (`self_attn.qkv_proj`) and gate/up as one (`mlp.gate_up_proj`)."""
        return self.architecture == "phi3"

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a model of this config has (HF checkpoint names), with its shape."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q, ffn = self.num_attention_heads * self.head_dim, self.intermediate_size
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        per_layer: dict[str, tuple[int, ...]] = {"self_attn.o_proj.weight": (h, q), "mlp.down_proj.weight": (h, ffn),
                                                 "input_layernorm.weight": (h,),
                                                 "post_attention_layernorm.weight": (h,)}
        if self.fused_projections:
            per_layer["self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
            per_layer["mlp.gate_up_proj.weight"] = (2 * ffn, h)
        else:
            per_layer.update({"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                              "self_attn.v_proj.weight": (kv, h), "mlp.gate_proj.weight": (ffn, h),
                              "mlp.up_proj.weight": (ffn, h)})
        if self.qkv_bias:
            per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                              "self_attn.v_proj.bias": (kv,)})
        if self.qk_norm:
            per_layer.update({"self_attn.q_norm.weight": (self.head_dim,),
                              "self_attn.k_norm.weight": (self.head_dim,)})
        for i in range(self.num_hidden_layers):
            for part, shape in per_layer.items():
                shapes[f"model.layers.{i}.{part}"] = shape
        return shapes

    # ---- from an HF config.json ------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        arch = d.get("model_type", "llama")
        if arch not in ARCHITECTURES:
            raise ValueError(f"model_type {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
        _refuse_unsupported_hf(d, arch)
        # transformers 5 writes rope_parameters {"rope_theta": ..., "rope_type": ...} instead of rope_theta and
        # rope_scaling; older files have those two.
        params = dict(d.get("rope_parameters") or {})
        for key, value in (d.get("rope_scaling") or {}).items():
            params.setdefault(key, value)
        rope_theta = d.get("rope_theta") or params.get("rope_theta", 10000.0)
        head_dim = int(d.get("head_dim") or 0) or int(d["hidden_size"]) // int(d["num_attention_heads"])
        max_positions = int(d.get("max_position_embeddings", 2048))
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        sliding = d.get("sliding_window") if arch == "phi3" else None
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            # A sliding window the context never exceeds changes nothing: the context stops there (Phi-3-mini-4k
            # has 2047; we do not run sliding-window attention).
            max_position_embeddings=min(max_positions, int(sliding)) if sliding else max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            rope_scaling=hf_rope_scaling(params, head_dim, max_positions,
                                         d.get("original_max_position_embeddings")),
        )


def _refuse_unsupported_hf(d: dict[str, Any], arch: str) -> None:
    """Options of these architectures that change the computation and that we do not implement: refused by name."""
    refused = []
    if d.get("attention_bias") and arch in ("llama", "qwen3"):
        refused.append("attention_bias")
    if d.get("mlp_bias"):
        refused.append("mlp_bias")
    if d.get("use_sliding_window") and arch in ("qwen2", "qwen3"):
        refused.append("use_sliding_window")
    if d.get("hidden_act", "silu") != "silu":
        refused.append(f"hidden_act={d.get('hidden_act')}")
    partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        refused.append("partial_rotary_factor")
    if refused:
        raise ValueError(f"model config ({arch}): {', '.join(refused)} is not supported")


def hf_rope_scaling(params: dict[str, Any], head_dim: int, max_positions: int,
                    original_max: int | None) -> dict[str, Any] | None:
    """rope_scaling in our form from HF's rope_parameters / rope_scaling (as transformers' modeling_rope_utils reads
    them); None for plain rotary."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "su":  # Phi-3's first name for longrope
        kind = "longrope"
    if kind == "default":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        return {"rope_type": "llama3", "factor": float(params["factor"]),
                "low_freq_factor": float(params["low_freq_factor"]),
                "high_freq_factor": float(params["high_freq_factor"]),
                "original_max_position_embeddings": int(params["original_max_position_embeddings"])}
    if kind == "longrope":
        original = int(params.get("original_max_position_embeddings") or original_max or max_positions)
        factor = params.get("factor") or max_positions / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            import math
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        long, short = [float(x) for x in params["long_factor"]], [float(x) for x in params["short_factor"]]
        if len(long) != head_dim // 2 or len(short) != head_dim // 2:
            raise ValueError(f"rope scaling longrope: long_factor and short_factor need {head_dim // 2} values")
        return {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                "original_max_position_embeddings": original, "attention_factor": float(attention_factor)}
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES[:4])})")
