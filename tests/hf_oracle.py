"""The reference our engine's tokens are checked against: HF transformers' greedy generate() on the same weights, a
batch of prompts left-padded with its attention mask (bench/generate.py times the same call as its baseline)."""
from __future__ import annotations

import torch


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of prompts of different lengths, left-padded to the longest with `pad`."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int, pad: int = 0,
              stop_at_eos: bool = True) -> list[list[int]]:
    """Each prompt's greedy continuation by HF generate() (a row that ends at the model's eos is padded with `pad`
    after it; stop_at_eos=False generates all `new_tokens` regardless)."""
    ids, mask = left_padded(prompts, pad)
    extra = {} if stop_at_eos else {"eos_token_id": None}
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=pad, **extra)
    return [row[ids.shape[1]:].tolist() for row in out]
