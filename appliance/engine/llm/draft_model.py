"""The draft model's forwards (`speculation: draft`): a smaller model with the target's tokenizer proposes each
speculating sequence's next tokens, greedily, before the step that verifies them (the engine calls `fill` between
the scheduler's plan and the runner).

The draft model has its own KV cache, one preallocated tensor with a slot for each of the target's slots. What a
slot of it holds is tracked as token ids (`held`): before drafting, a slot keeps its longest prefix that agrees with
the target slot's tokens and computes the rest. So the drafted tokens the target refused (and anything else the
target's slot lost: a cancelled turn, a parked or evicted conversation, a prefix loaded from the cache) are rolled
back at the next draft, and a slot that changed owner is recomputed, with no bookkeeping of its own to go stale.
Catching up is bounded per step (CATCH_UP_TOKENS): a long prompt is fed over a few steps, drafting nothing until it
is in, so a step never waits for a whole prompt through the draft model.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from appliance.engine.llm.scheduler import DecodeRow, StepPlan
from appliance.engine.llm.slots import SlotManager

CATCH_UP_TOKENS = 256  # a slot's tokens fed to the draft model in one step at most (as the target's prefill_chunk)
TOKEN_FORWARD_MAX = 16  # a forward that feeds at most this many tokens a row is a drafting one, not a catch-up


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists (list compares run in C: bisect on them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class DraftModel:
    """Greedy drafts from the draft model for a step's rows that ask for them (DecodeRow.draft_wanted)."""

    def __init__(self, model: Any, cache: Any):
        self.model = model  # models.llama.LlamaModel
        self.cache = cache  # models.llama.KVCache, cache.n_slots == the target's kv_slots
        self.held: list[list[int]] = [[] for _ in range(cache.n_slots)]  # per slot: the tokens its KV holds
        self.forwards = 0  # draft model forwards run and the seconds they took (benchmarks: the draft's cost)
        self.seconds = 0.0
        self.token_forwards = 0  # of them, those that fed a token or a few a row (not a prompt's catch-up), and
        self.token_seconds = 0.0  # their seconds: what a drafted token costs (the engine's cost gate)

    @torch.no_grad()
    def fill(self, plan: StepPlan, slots: SlotManager) -> None:
        """Set row.draft (draft_wanted tokens) on every row of the plan that asks for a draft."""
        rows = [r for r in plan.decode if r.draft_wanted > 0 and r.pos + r.draft_wanted <= self.cache.max_seq_len]
        if not rows:
            return
        ready: list[DecodeRow] = []
        chunks: list[tuple[DecodeRow, int, list[int]]] = []  # row, start position, tokens to feed
        for r in rows:
            context = slots.slot(r.slot).tokens[:r.pos + 1]  # the row's token last, at r.pos
            held = self.held[r.slot]
            start = min(common_prefix(held, context), r.pos)  # the last token is fed again: its logits draft
            del held[start:]
            feed = context[start:start + CATCH_UP_TOKENS]
            chunks.append((r, start, feed))
            held.extend(feed)
            if start + len(feed) == r.pos + 1:
                ready.append(r)
        logits = self._forward([c[2] for c in chunks], [c[0].slot for c in chunks], [c[1] for c in chunks])
        last = {id(c[0]): int(t) for c, t in zip(chunks, logits.argmax(dim=-1).tolist())}
        for r in ready:
            r.draft = [last[id(r)]]
        # one forward per further drafted token, over the rows that still want one
        while True:
            going = [r for r in ready if len(r.draft) < r.draft_wanted]
            if not going:
                return
            logits = self._forward([[r.draft[-1]] for r in going], [r.slot for r in going],
                                   [r.pos + len(r.draft) for r in going])
            for r, t in zip(going, logits.argmax(dim=-1).tolist()):
                self.held[r.slot].append(r.draft[-1])
                r.draft.append(int(t))

    def _forward(self, feeds: list[list[int]], slots: list[int], starts: list[int]) -> torch.Tensor:
        """The draft model over ragged rows; each row's last logits (B, vocab)."""
        started = time.perf_counter()
        ids = torch.zeros(len(feeds), max(len(f) for f in feeds), dtype=torch.long)
        for i, f in enumerate(feeds):
            ids[i, :len(f)] = torch.tensor(f, dtype=torch.long)
        logits = self.model.forward(self.cache, ids, torch.tensor(slots), torch.tensor(starts),
                                    torch.tensor([len(f) for f in feeds]))
        took = time.perf_counter() - started
        self.forwards += 1
        self.seconds += took
        if ids.shape[1] <= TOKEN_FORWARD_MAX:
            self.token_forwards += 1
            self.token_seconds += took
        return logits

    def forget_all(self) -> None:
        """The target's slots were all dropped (new weights): nothing held is worth comparing against."""
        for held in self.held:
            held.clear()
