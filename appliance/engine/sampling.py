"""Next-token choice: temperature 0 is argmax (deterministic); otherwise temperature + top-p, drawn with a
per-request `torch.Generator` seeded from the engine seed and a request counter, so a run is reproducible. A row
under a grammar has its disallowed tokens set to -inf first (`apply_token_masks`): argmax picks the likeliest allowed
token, and a draw comes from the distribution renormalized over the allowed ones."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

_BIT = torch.arange(32, dtype=torch.int32)


def request_seed(engine_seed: int, counter: int) -> int:
    """A well-mixed 63-bit seed per request (neighbouring counters must not give correlated streams)."""
    digest = hashlib.sha256(f"{engine_seed}:{counter}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")  # sampling runs on the host: one small softmax per row
    g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of fp32 logits (B, vocab)."""
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, temp in enumerate(temperatures):
        if temp <= 0.0:
            out.append(int(greedy[i]))
            continue
        probs = torch.softmax(logits[i].float().cpu() / temp, dim=-1)
        top_p = top_ps[i]
        if top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < top_p  # always keeps the most likely token
            sorted_p = sorted_p * keep
            choice = torch.multinomial(sorted_p, 1, generator=generators[i])
            out.append(int(order[choice]))
        else:
            out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out


def apply_token_masks(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    """logits (B, vocab) with row rows[k]'s tokens whose bit is 0 in bitmask[k] (int32 words, bit i % 32 of word
    i // 32) set to -inf. Returns a new tensor (the caller's logits may be a view of the model's buffers)."""
    vocab = logits.shape[1]
    words = torch.from_numpy(bitmask)
    allowed = ((words.unsqueeze(-1) >> _BIT) & 1).view(len(rows), -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # ids past the mask's width are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    out = logits.float().clone()
    index = torch.tensor(rows, dtype=torch.long)
    out[index] = out[index].masked_fill(~allowed.to(out.device), float("-inf"))
    return out
