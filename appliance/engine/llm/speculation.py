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


class ModelDrafter(DraftLength):
    """A sequence drafted by the draft model: the engine asks draft_model.DraftModel for `wanted` tokens."""


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
