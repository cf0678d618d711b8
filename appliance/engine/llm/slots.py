"""KV-cache slots owned by sessions (torch-free; the engine thread is the only caller).

A slot holds one session's whole conversation. `tokens` is the conversation as token ids; the first `kv_len` of them
have their keys/values in the cache, the rest are pending (written by the next prefill or decode step). A follow-up
turn therefore costs only its new tokens. Sessions whose conversation was dropped (reloaded, or evicted with no room
to park it) are remembered so their next call reports ContextLost.

Parking: an idle slot taken for another session (evict_lru) is not dropped when `park_tokens` allows: its
conversation is parked (tokens and history here; the runner copies its keys and values out to host memory) and
restored into a slot at the session's next call, with no ContextLost. The copies are ordered `SlotMove`s the
scheduler hands to the runner in the next step's plan, before that step writes anything. Parked conversations are
bounded in tokens, oldest dropped first (those sessions then see ContextLost).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

POLICIES = ("evict_lru", "reject")
LOST_MEMORY = 4096  # sessions remembered as context-lost (oldest forgotten first; a closed session is removed)


@dataclass
class Slot:
    index: int
    owner: str | None = None
    tokens: list[int] = field(default_factory=list)
    kv_len: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # chat messages the tokens render
    busy: bool = False  # a sequence is running in it: never evicted
    last_used: int = 0

    def clear(self) -> None:
        self.owner = None
        self.tokens = []
        self.kv_len = 0
        self.history = []
        self.busy = False


@dataclass
class Parked:
    tokens: list[int]
    kv_len: int
    history: list[dict[str, Any]]


@dataclass
class SlotMove:
    kind: str  # "park": copy slot's first `length` positions out under `session`; "restore": copy them back in;
    #            "discard": forget the session's parked copy
    session: str
    slot: int = -1
    length: int = 0


@dataclass
class Acquired:
    slot: int
    context_lost: bool  # the session had a conversation that was dropped since its last call
    evicted: str | None = None  # the session whose idle slot was taken


class SlotManager:
    def __init__(self, n_slots: int, max_seq_len: int, policy: str = "evict_lru", park_tokens: int = 0,
                 recall: Callable[[str], Parked | None] | None = None):
        if n_slots < 1:
            raise ValueError("kv_slots must be at least 1")
        if policy not in POLICIES:
            raise ValueError(f"slot policy must be one of {', '.join(POLICIES)}")
        self.slots = [Slot(i) for i in range(n_slots)]
        self.max_seq_len = max_seq_len
        self.policy = policy
        self._by_session: dict[str, int] = {}
        self._lost: OrderedDict[str, bool] = OrderedDict()
        self._clock = 0
        self.park_tokens = park_tokens  # KV positions parked conversations may hold in all (0: no parking)
        self._parked: OrderedDict[str, Parked] = OrderedDict()
        self._moves: list[SlotMove] = []
        # A conversation held neither in a slot nor parked, from elsewhere (conversation_files: its tokens, kv_len 0)
        self.recall = recall

    @property
    def parked(self) -> int:
        return len(self._parked)

    def take_moves(self) -> list[SlotMove]:
        """The KV copies the runner must make, in order, before the next step's forwards."""
        moves, self._moves = self._moves, []
        return moves

    # -- queries ---------------------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def in_use(self) -> int:
        return len(self._by_session)

    def lookup(self, session: str) -> int | None:
        return self._by_session.get(session)

    def slot(self, index: int) -> Slot:
        return self.slots[index]

    def tokens_held(self, index: int) -> int:
        return len(self.slots[index].tokens)

    def can_acquire(self, session: str) -> bool:
        """Would acquire() succeed now (without changing anything)?"""
        if session in self._by_session or any(s.owner is None for s in self.slots):
            return True
        return self.policy == "evict_lru" and any(not s.busy for s in self.slots)

    # -- changes ---------------------------------------------------------------------------------------------
    def acquire(self, session: str) -> Acquired | None:
        """The session's slot (kept from earlier turns), a free one, or the LRU idle one (evict_lru).

        None when nothing can be had: every slot is owned (reject) or every slot is generating (evict_lru).
        """
        lost = self._lost.pop(session, False)
        index = self._by_session.get(session)
        if index is not None:
            self.touch(index)
            return Acquired(index, lost)
        free = [s for s in self.slots if s.owner is None]
        evicted = None
        if free:
            chosen = free[0]  # lowest index: keeps concurrent slots consecutive (cache views, no gather)
        elif self.policy == "evict_lru":
            idle = [s for s in self.slots if not s.busy]
            if not idle:
                if lost:
                    self._remember_lost(session)
                return None
            chosen = min(idle, key=lambda s: s.last_used)
            evicted = chosen.owner
            # this session's own parked copy leaves the bound first: parking the evicted one must not drop it
            parked = self._parked.pop(session, None)
            if not self._park(chosen):
                self._drop(chosen, lost=True)
            if parked is not None:
                self._parked[session] = parked
        else:
            if lost:
                self._remember_lost(session)
            return None
        chosen.owner = session
        self._by_session[session] = chosen.index
        self.touch(chosen.index)
        parked = self._parked.pop(session, None)
        if parked is not None:  # its conversation comes back: nothing was lost
            chosen.tokens, chosen.kv_len, chosen.history = parked.tokens, parked.kv_len, parked.history
            self._moves.append(SlotMove("restore", session, chosen.index, parked.kv_len))
        elif self.recall is not None and not lost:
            recalled = self.recall(session)  # kept on disk: its tokens come back, the prefill recomputes their KV
            if recalled is not None:
                chosen.tokens, chosen.kv_len, chosen.history = recalled.tokens, 0, recalled.history
        return Acquired(chosen.index, lost, evicted)

    def _park(self, slot: Slot) -> bool:
        """Park an idle slot's conversation instead of dropping it; False when it cannot be kept."""
        if slot.owner is None or slot.kv_len < 1 or slot.kv_len > self.park_tokens:
            return False
        owner = slot.owner
        self._moves.append(SlotMove("park", owner, slot.index, slot.kv_len))
        self._parked[owner] = Parked(list(slot.tokens), slot.kv_len, slot.history)  # pending tokens come back too
        self._by_session.pop(owner, None)
        slot.clear()
        while sum(p.kv_len for p in self._parked.values()) > self.park_tokens:
            oldest, _ = self._parked.popitem(last=False)
            self._moves.append(SlotMove("discard", oldest))
            self._remember_lost(oldest)
        return True

    def _forget_parked(self, session: str) -> None:
        if self._parked.pop(session, None) is not None:
            self._moves.append(SlotMove("discard", session))

    def touch(self, index: int) -> None:
        self._clock += 1
        self.slots[index].last_used = self._clock

    def set_busy(self, index: int, busy: bool) -> None:
        self.slots[index].busy = busy
        self.touch(index)

    def release(self, session: str) -> bool:
        """Give the session's slot back (session closed, timed out or reset). Idempotent; False if it had none.

        The caller ends any sequence running in the slot first (Scheduler.cancel_session).
        """
        self._lost.pop(session, None)
        self._forget_parked(session)
        index = self._by_session.get(session)
        if index is None:
            return False
        self._drop(self.slots[index], lost=False)
        return True

    def drop_all(self) -> list[str]:
        """Forget every conversation (new weights): each owner is marked context-lost. Returns those sessions."""
        owners = [s.owner for s in self.slots if s.owner is not None]
        for s in self.slots:
            if s.owner is not None:
                self._drop(s, lost=True)
        for session in list(self._parked):
            self._forget_parked(session)
            self._remember_lost(session)
            owners.append(session)
        return owners

    def truncate(self, index: int, length: int) -> None:
        """Roll a slot's conversation back to its first `length` tokens (a cancelled or failed turn)."""
        slot = self.slots[index]
        del slot.tokens[length:]
        slot.kv_len = min(slot.kv_len, length)

    def mark_lost(self, session: str) -> None:
        """The session's conversation ended without it asking (a TTL): its next call says ContextLost."""
        self._remember_lost(session)

    def is_lost(self, session: str) -> bool:
        return session in self._lost

    def _drop(self, slot: Slot, lost: bool) -> None:
        if slot.owner is not None:
            self._by_session.pop(slot.owner, None)
            if lost:
                self._remember_lost(slot.owner)
        slot.clear()

    def _remember_lost(self, session: str) -> None:
        self._lost[session] = True
        self._lost.move_to_end(session)
        while len(self._lost) > LOST_MEMORY:
            self._lost.popitem(last=False)
