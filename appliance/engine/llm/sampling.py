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
    i // 32) set to -inf, in place (returned). Each row costs one pass over it at most: where few tokens are allowed
    (an enum, a number, punctuation) they are kept and the row filled around them; where most are (a string's
    characters) the few refused ones are set. Measured on the demo's 49,152-token rows: a bool mask expanded with
    torch took 0.5 ms a row on a loaded 2-core machine, this about 0.05 ms."""
    vocab = logits.shape[1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(np.bool_)
    for k, i in enumerate(rows):
        keep, row = allowed[k], logits[i]
        if np.count_nonzero(keep) * 2 <= vocab:
            index = torch.from_numpy(np.flatnonzero(keep)).to(row.device)
            values = row.index_select(0, index)
            row.fill_(float("-inf"))
            row.index_copy_(0, index, values)
        else:
            row.index_fill_(0, torch.from_numpy(np.flatnonzero(~keep)).to(row.device), float("-inf"))
        if len(keep) < vocab:  # ids past the mask's width are never allowed
            row[len(keep):] = float("-inf")
    return logits


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution `sample` draws from for one row (fp32 logits (vocab,)): temperature, then top-p."""
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        probs = torch.zeros_like(probs).index_copy_(0, order, sorted_p * keep)
        probs /= probs.sum()
    return probs


def verify_token(logits: torch.Tensor, draft: int, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> tuple[bool, int]:
    """One position of a drafted stretch (speculation.py): (accepted, the token the reply takes here).

    Greedy: the draft is kept when it is the argmax. Sampled: the proposal is deterministic (a lookup draft), so the
    standard rejection scheme reduces to: keep the draft with probability p(draft); otherwise draw from p with the
    draft removed, renormalized. The token that results is distributed as p, as plain sampling's is."""
    if temperature <= 0.0:
        token = int(logits.argmax())
        return token == draft, token
    probs = target_probs(logits, temperature, top_p)
    p = float(probs[draft])
    if p > 0.0 and float(torch.rand((), generator=generator)) < p:
        return True, draft
    probs[draft] = 0.0
    if float(probs.sum()) <= 0.0:  # p(draft) was 1 up to rounding: nothing else can be drawn
        return True, draft
    return False, int(torch.multinomial(probs, 1, generator=generator))


def sample_one(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """A plain draw for one row (the token after a draft that was accepted whole)."""
    return sample(logits.view(1, -1), [temperature], [top_p], [generator])[0]
