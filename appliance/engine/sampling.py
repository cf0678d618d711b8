"""Next-token choice: temperature 0 is argmax (deterministic); otherwise temperature + top-p, drawn with a
per-request `torch.Generator` seeded from the engine seed and a request counter, so a run is reproducible."""
from __future__ import annotations

import hashlib

import torch


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
