"""SlotManager: session -> slot ownership, LRU eviction of idle slots, reject policy, context-lost bookkeeping."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine.llm.slots import LOST_MEMORY, SlotManager


def test_importing_the_slot_and_scheduler_modules_needs_no_torch():
    code = ("import sys, appliance.engine.llm.slots, appliance.engine.llm.scheduler, appliance.engine.llm.sequence; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_session_keeps_its_slot_and_new_ones_take_the_lowest_free():
    m = SlotManager(3, 100)
    assert m.acquire("a").slot == 0
    assert m.acquire("b").slot == 1
    assert m.acquire("a").slot == 0
    assert m.lookup("b") == 1 and m.lookup("zz") is None
    assert m.in_use == 2


def test_evict_lru_takes_the_least_recently_used_idle_slot_never_a_busy_one():
    m = SlotManager(3, 100, "evict_lru")
    for s in "abc":
        m.acquire(s)
    m.set_busy(m.lookup("a"), True)  # a: generating, though least recently used
    m.acquire("c")  # touch c: b is now the LRU idle slot
    got = m.acquire("d")
    assert got.evicted == "b" and got.slot == 1 and not got.context_lost
    assert m.lookup("b") is None and m.lookup("a") == 0
    assert m.tokens_held(1) == 0  # the evicted conversation is gone
    back = m.acquire("b")  # b comes back: told its context was lost, once
    assert back.context_lost and back.evicted in {"c", "d"}
    m.release("b")
    assert not m.acquire("b").context_lost


def test_evict_lru_with_every_slot_generating_gives_nothing():
    m = SlotManager(2, 100, "evict_lru")
    for s in "ab":
        m.set_busy(m.acquire(s).slot, True)
    assert m.acquire("c") is None
    assert not m.can_acquire("c") and m.can_acquire("a")
    m.set_busy(0, False)
    assert m.acquire("c").evicted == "a"


def test_reject_policy_never_evicts():
    m = SlotManager(1, 100, "reject")
    m.acquire("a")
    assert m.acquire("b") is None and not m.can_acquire("b")
    assert m.lookup("a") == 0
    assert m.release("a") is True
    assert m.acquire("b").slot == 0


def test_release_is_idempotent_and_frees_the_slot():
    m = SlotManager(2, 100)
    i = m.acquire("a").slot
    m.slot(i).tokens.extend([1, 2, 3])
    m.slot(i).kv_len = 3
    assert m.release("a") is True
    assert m.release("a") is False
    assert m.in_use == 0 and m.slot(i).tokens == [] and m.slot(i).owner is None


def test_drop_all_marks_every_owner_context_lost():
    m = SlotManager(2, 100)
    m.acquire("a")
    m.acquire("b")
    assert sorted(m.drop_all()) == ["a", "b"]
    assert m.in_use == 0
    assert m.acquire("a").context_lost and m.acquire("b").context_lost


def test_truncate_rolls_back_tokens_and_cache_length():
    m = SlotManager(1, 100)
    slot = m.slot(m.acquire("a").slot)
    slot.tokens.extend(range(10))
    slot.kv_len = 9
    m.truncate(slot.index, 4)
    assert slot.tokens == [0, 1, 2, 3] and slot.kv_len == 4
    slot.kv_len = 2
    m.truncate(slot.index, 3)
    assert slot.kv_len == 2


def test_lost_sessions_are_remembered_boundedly():
    m = SlotManager(1, 100, "evict_lru")
    for i in range(LOST_MEMORY + 10):
        m.acquire(f"s{i}")
    assert len(m._lost) <= LOST_MEMORY
    assert m.is_lost(f"s{LOST_MEMORY + 8}") and not m.is_lost("s0")


def test_bad_arguments():
    with pytest.raises(ValueError):
        SlotManager(0, 10)
    with pytest.raises(ValueError):
        SlotManager(1, 10, "random")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["acquire", "release", "busy", "idle"]), st.integers(0, 5)),
                max_size=60), st.sampled_from(["evict_lru", "reject"]))
def test_ownership_stays_consistent_under_any_sequence_of_operations(ops, policy):
    m = SlotManager(3, 100, policy)
    for op, n in ops:
        session = f"s{n}"
        if op == "acquire":
            busy_before = {s.index: s.owner for s in m.slots if s.busy}
            got = m.acquire(session)
            for index, owner in busy_before.items():  # a generating slot is never taken
                assert m.slot(index).owner == owner
            if got is None:
                assert policy == "reject" or all(s.busy for s in m.slots)
        elif op == "release":
            index = m.lookup(session)
            if index is None or not m.slot(index).busy:
                m.release(session)
        elif m.lookup(session) is not None:
            m.set_busy(m.lookup(session), op == "busy")
        owners = [s.owner for s in m.slots if s.owner is not None]
        assert len(owners) == len(set(owners)) == m.in_use
        for s in m.slots:
            if s.owner is not None:
                assert m.lookup(s.owner) == s.index


def test_evicted_conversation_is_parked_restored_and_bounded():
    from appliance.engine.llm.slots import SlotManager
    m = SlotManager(1, 64, "evict_lru", park_tokens=10)
    a = m.acquire("a")
    m.slot(a.slot).tokens, m.slot(a.slot).kv_len = [1, 2, 3, 4, 5, 6, 7], 6  # one token still pending
    b = m.acquire("b")  # takes a's slot: a is parked, not lost
    assert b.slot == a.slot and not m.is_lost("a") and m.parked == 1
    assert [(x.kind, x.session, x.length) for x in m.take_moves()] == [("park", "a", 6)]
    m.slot(b.slot).tokens, m.slot(b.slot).kv_len = [9] * 5, 5
    again = m.acquire("a")  # b parked, a restored with its pending token
    assert not again.context_lost and m.slot(again.slot).tokens == [1, 2, 3, 4, 5, 6, 7]
    assert m.slot(again.slot).kv_len == 6
    assert [(x.kind, x.session) for x in m.take_moves()] == [("park", "b"), ("restore", "a")]
    m.slot(again.slot).kv_len = 9
    m.acquire("c")  # a (9 tokens) parked beside b (5): over 10 tokens, the oldest (b) is dropped
    assert [(x.kind, x.session) for x in m.take_moves()] == [("park", "a"), ("discard", "b")]
    assert m.is_lost("b") and m.parked == 1
    m.release("a")  # a closed session forgets its parked copy
    assert [(x.kind, x.session) for x in m.take_moves()] == [("discard", "a")] and m.parked == 0
