"""Speculation's drafters (torch-free): what proposes a sequence's next tokens, and how many.

Two sources of drafts: the sequence's own prompt and output (`lookup`, below), or a smaller model that shares the
target's tokenizer (`draft`: the engine runs it, draft_model.py; here only its length policy, `ModelDrafter`).

A reply that copies from its prompt (a field out of an alarm text, a restated shift log, a JSON value) repeats
n-grams the slot already holds: the tokens that followed the latest earlier occurrence of the last n tokens
(n from `max_ngram` down to `min_ngram`) are the draft. The engine verifies a draft in one step (a decode row of
1 + k tokens through the many-row kernels) and keeps the longest prefix the target model agrees with, so the
answer is the one plain decoding gives (greedy: token for token; sampled: the same distribution, see
sampling.verify_draft).

The draft length adapts per sequence (from 4, `DraftLength`, the same policy for both sources): it doubles while drafts are accepted whole, shrinks to what was accepted on
a partial rejection, and a draft with nothing accepted puts drafting off for a number of steps that doubles with
each such miss (a reply with nothing to copy then runs almost only plain decode steps).
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("off", "lookup", "draft")
MAX_COOLDOWN = 32  # steps without drafting after repeated misses, at most


@dataclass(frozen=True)
class SpeculationSettings:
    mode: str = "off"  # off | lookup | draft
    draft_min: int = 1  # a shorter draft is not worth a verify step
    draft_max: int = 8
    min_ngram: int = 3  # shorter matches propose too much that is wrong (measured on free answers)
    max_ngram: int = 4
    cost_gate: bool = True  # draft: a draft only where its measured cost pays (best_draft_length); tests of the
    # verification alone turn it off, so that a draft as dear as the target still drafts

    @property
    def enabled(self) -> bool:
        return self.mode in ("lookup", "draft")


class DraftLength:
    """One sequence's adaptive draft length: how many tokens its next draft may have (0: none this step)."""

    def __init__(self, settings: SpeculationSettings):
        self.settings = settings
        self.length = max(settings.draft_min, min(4, settings.draft_max))  # the next draft's length at most
        self.cooldown = 0  # steps left without drafting
        self._miss_pause = 0  # the pause after the next miss (doubles per miss, reset on an accepted token)
        self.drafted = 0  # tokens proposed and tokens accepted (acceptance rate)
        self.accepted = 0

    def wanted(self, room: int) -> int:
        """The next draft's length: min(length, room), or 0 while paused or below draft_min (a paused step counts)."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        want = min(self.length, room)
        return want if want >= self.settings.draft_min else 0

    def record(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens was verified and its first `accepted` kept: adapt the length."""
        s = self.settings
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.length = min(s.draft_max, self.length * 2)
            self._miss_pause = 0
        elif accepted > 0:
            self.length = max(s.draft_min, accepted)
            self._miss_pause = 0
        else:
            self.length = max(s.draft_min, self.length // 2)
            self._miss_pause = min(MAX_COOLDOWN, max(1, self._miss_pause * 2))
            self.cooldown = self._miss_pause


GATE_PAUSE = 64  # steps a sequence drafts nothing after the cost gate found that no draft pays; then one short
# draft probes again (its forward and its acceptance measured anew): at most ~1.5 % of the steps' time where a draft
# forward costs a whole step
PRIOR_ACCEPTED, PRIOR_MISSES = 9, 1  # before a verified draft: 0.9 a token (a draft model is chosen to agree)


def best_draft_length(acceptance: float, cost: float, rows: int, shortest: int, longest: int) -> int:
    """The draft length that gives a step the most tokens per unit of time, 0 where none beats plain decoding.

    A k-token draft of one row costs k draft forwards in front of a step of `rows` rows (cost: one draft forward's
    time over one step's) and yields, expected, 1 + a + ... + a^k tokens for that row where plain decoding yields 1
    (a: the chance that a drafted token is accepted, each in turn). Plain: `rows` tokens per step time; drafted:
    rows - 1 + E(k) per (1 + k * cost) of it. Counting the whole forward against each row is the dear side: rows
    drafting in one step share their forwards."""
    best, best_ratio = 0, 1.0
    for k in range(max(1, shortest), longest + 1):
        expected = k + 1.0 if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)
        ratio = (rows - 1 + expected) / (rows * (1.0 + k * cost))
        if ratio > best_ratio:
            best, best_ratio = k, ratio
    return best


class ModelDrafter(DraftLength):
    """A sequence drafted by the draft model: the engine asks draft_model.DraftModel for `wanted` tokens.

    A draft model costs forwards of its own, unlike a lookup: where the engine has measured that cost, the length
    is also held to what pays (best_draft_length, from the acceptance this sequence's drafts have had), and a
    sequence whose drafts cannot pay drafts nothing for GATE_PAUSE steps, then drafts one short probe before the
    gate looks again (as its first draft is)."""

    def __init__(self, settings: SpeculationSettings):
        super().__init__(settings)
        self.misses = 0  # drafts cut short by a refused token
        self._probe = True  # the next draft is a short one whatever the gate says: a sequence's first and the one
        # after a gate pause (each measures the draft's cost and this sequence's acceptance anew)

    def record(self, drafted: int, accepted: int) -> None:
        super().record(drafted, accepted)
        if accepted < drafted:
            self.misses += 1

    @property
    def acceptance(self) -> float:
        """A drafted token's chance to be accepted (geometric: accepted tokens over accepted tokens and misses)."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.accepted + PRIOR_ACCEPTED + self.misses + PRIOR_MISSES)

    def wanted_at_cost(self, room: int, cost: float | None, rows: int) -> int:
        """wanted(room), held to what pays at `cost` (a draft forward's time over a step's; None: not measured)."""
        want = self.wanted(room)
        if not want or cost is None or not self.settings.cost_gate:
            return want
        if self._probe:
            self._probe = False
            return min(want, max(1, self.settings.draft_min))
        best = best_draft_length(self.acceptance, cost, rows, self.settings.draft_min, want)
        if best == 0:
            self.cooldown, self._probe = GATE_PAUSE, True
        return best


class LookupDrafter(DraftLength):
    """One sequence's n-gram index over its slot's tokens (its draft length: DraftLength)."""

    def __init__(self, settings: SpeculationSettings):
        super().__init__(settings)
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0  # n-grams ending at positions < this are in the index

    def propose(self, tokens: list[int], room: int) -> list[int]:
        """Up to min(length, room) tokens to follow `tokens` (the slot's tokens: prompt, reply so far); [] when
        nothing matches, drafting is paused, or the draft would be shorter than draft_min."""
        s = self.settings
        want = self.wanted(room)
        if not want:
            return []
        end = len(tokens) - 1  # n-grams ending before the last token: the suffix must match an earlier stretch
        if end < self._indexed:  # the slot was cut back (never while a sequence runs; be safe)
            self._index.clear()
            self._indexed = 0
        for e in range(max(self._indexed, 1), end + 1):
            for n in range(s.min_ngram, s.max_ngram + 1):
                if e >= n:
                    self._index[tuple(tokens[e - n:e])] = e
        self._indexed = end + 1
        for n in range(s.max_ngram, s.min_ngram - 1, -1):
            if len(tokens) < n:
                continue
            at = self._index.get(tuple(tokens[len(tokens) - n:]))
            if at is not None:
                draft = tokens[at:at + want]
                return draft if len(draft) >= s.draft_min else []
        return []
