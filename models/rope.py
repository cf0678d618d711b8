"""Rotary position frequencies of a config, with its scaling, computed as transformers computes them (the oracle):
inv_freq in fp32 from an int64 arange, then cos/sin of position x inv_freq, times the attention factor.

The context decides longrope's factors as llama.cpp does (the whole cache uses the long ones when it is longer than
the model's original context, else the short ones): transformers switches per forward pass by the longest position
so far, which is the same for every context up to the original length (4096 for Phi-3.5-mini).
"""
from __future__ import annotations

import math

import torch

from models.llama_config import LlamaConfig


def inv_freq(config: LlamaConfig, context: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim // 2,) fp32, attention factor) for a cache of `context` positions."""
    hd, base = config.head_dim, config.rope_theta
    exponents = torch.arange(0, hd, 2, dtype=torch.int64).float() / hd
    plain = 1.0 / (base ** exponents)
    s = config.rope_scaling
    if s is None:
        return plain, 1.0
    kind = s["rope_type"]
    if kind == "linear":
        return plain / s["factor"], 1.0
    if kind == "freq_factors":  # llama.cpp's rope_freqs: theta / factor per frequency
        return plain / torch.tensor(s["freq_factors"], dtype=torch.float32), 1.0
    if kind == "llama3":
        return _llama3(plain, s), 1.0
    if kind == "longrope":
        factors = s["long_factor"] if context > s["original_max_position_embeddings"] else s["short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents), float(s["attention_factor"])
    raise ValueError(f"rope scaling {kind!r} is not supported")


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """transformers' _compute_llama3_parameters: long wavelengths divided by `factor`, short ones kept, a smooth
    blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def angle_tables(config: LlamaConfig, positions: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (positions, head_dim // 2) fp32 for positions 0..positions-1, attention factor applied."""
    inv, attention_factor = inv_freq(config, context)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor
