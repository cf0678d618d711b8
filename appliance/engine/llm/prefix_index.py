"""Shared prompt prefixes: which token prefixes have their KV state kept for reuse (torch-free).

A conversation's first turn starts with the same tokens for every session of a model (the chat template's system
prompt, a plant's standing instructions, the user-turn header): the turn policy says how many of its tokens are
that shared head. The first sequence to compute a head stores its KV (the runner copies it out of the slot after
the forward that wrote it); a later sequence with the same head starts with a copy in its slot and prefills only
the rest. The index is LRU-bounded; the runner holds the tensors under the same keys.
"""
from __future__ import annotations

from collections import OrderedDict

MIN_SHARED_TOKENS = 8  # shorter heads are cheaper to recompute than to copy and track

Key = tuple[int, ...]


class PrefixIndex:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._keys: OrderedDict[Key, None] = OrderedDict()
        self.evicted: list[Key] = []  # dropped since the runner last heard; it frees their tensors
        self.hits = 0

    def __len__(self) -> int:
        return len(self._keys)

    def lookup(self, tokens: list[int], shared: int) -> Key | None:
        """The key of a stored head of `tokens` (its first `shared` tokens), or None."""
        if self.capacity < 1 or shared < MIN_SHARED_TOKENS:
            return None
        key = tuple(tokens[:shared])
        if key in self._keys:
            self._keys.move_to_end(key)
            self.hits += 1
            return key
        return None

    def wanted(self, tokens: list[int], shared: int) -> Key | None:
        """The key under which this head should be stored once computed (None: not worth it, or already there)."""
        if self.capacity < 1 or shared < MIN_SHARED_TOKENS:
            return None
        key = tuple(tokens[:shared])
        return None if key in self._keys else key

    def add(self, key: Key) -> None:
        """The head's KV was stored (the step that computed it succeeded)."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            old, _ = self._keys.popitem(last=False)
            self.evicted.append(old)

    def take_evicted(self) -> list[Key]:
        out, self.evicted = self.evicted, []
        return out

    def clear(self) -> None:
        """New weights: every stored KV is meaningless."""
        self.evicted.extend(self._keys)
        self._keys.clear()
