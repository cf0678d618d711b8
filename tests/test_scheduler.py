"""The continuous-batching scheduler without a model: plans are checked step by step with fabricated tokens."""
from __future__ import annotations

from appliance.engine.llm.scheduler import Scheduler
from appliance.engine.llm.sequence import FinishReason, Sequence, SeqState
from appliance.engine.llm.slots import SlotManager
from core.errors import DeadlineExceeded, InvalidArgument, ResourceUnavailable

EOS = 0


class Turns:
    """TurnPolicy over token ids: a prompt "n" adds n tokens; token EOS stops."""

    def prepare(self, seq, slot, acquired):
        slot.tokens.extend([5] * int(seq.prompt))

    def accept(self, seq, slot, token):
        if token == EOS:
            return FinishReason.STOP
        seq.generated.append(token)
        slot.tokens.append(token)
        return FinishReason.LENGTH if len(seq.generated) >= seq.max_tokens else None

    def close(self, seq, slot):
        slot.tokens.append(99)  # an end-of-turn marker


def make(n_slots=4, max_seq=1000, policy="evict_lru", chunk=16, budget=None):
    slots = SlotManager(n_slots, max_seq, policy)
    return slots, Scheduler(slots, Turns(), prefill_chunk=chunk, max_prefill_tokens=budget)


def step(sched, token=7, now=None, tokens=None):
    """One engine step: every row that produced logits samples `token` (or tokens[session])."""
    plan = sched.schedule(now)
    tokens = tokens or {}
    rows = [c.seq for c in plan.prefill if c.last] + [r.seq for r in plan.decode]
    sampled = {s.request_id: tokens.get(s.session_key, token) for s in rows}
    finished = sched.commit(plan, sampled, now)
    return plan, finished


def seq(session, prompt_len, max_tokens=50, deadline=float("inf")):
    return Sequence(session_key=session, prompt=str(prompt_len), max_tokens=max_tokens, deadline=deadline)


def test_a_long_prompt_is_chunked_and_never_stalls_decoding():
    slots, sched = make(chunk=16)
    short = seq("a", 4)
    sched.add(short)
    step(sched)  # prefill of 4 tokens completes: a decodes from now on
    assert short.state is SeqState.DECODE and len(short.generated) == 1
    long = seq("b", 100)
    sched.add(long)
    decoded_before = len(short.generated)
    steps = 0
    while long.state is SeqState.PREFILL or steps == 0:
        plan, _ = step(sched)
        steps += 1
        assert [r.seq for r in plan.decode] == [short]  # the decoder runs every step
        assert len(plan.prefill) <= 1 and all(len(c.tokens) <= 16 for c in plan.prefill)
    assert steps == 7  # ceil(100 / 16)
    assert len(short.generated) == decoded_before + steps
    assert slots.slot(long.slot).kv_len == 100 and len(long.generated) == 1


def test_prefill_budget_is_shared_oldest_first():
    _, sched = make(chunk=16, budget=24)
    first, second = seq("a", 40), seq("b", 40)
    sched.add(first)
    sched.add(second)
    plan, _ = step(sched)
    assert [(c.seq, len(c.tokens)) for c in plan.prefill] == [(first, 16), (second, 8)]
    plan, _ = step(sched)
    assert sum(len(c.tokens) for c in plan.prefill) <= 24
    assert plan.prefill[0].seq is first and plan.prefill[0].start_pos == 16


def test_decode_rows_carry_each_slots_own_position():
    slots, sched = make()
    a, b = seq("a", 3), seq("b", 9)
    sched.add(a)
    sched.add(b)
    step(sched)
    plan, _ = step(sched)
    rows = {r.seq.session_key: r for r in plan.decode}
    assert (rows["a"].pos, rows["b"].pos) == (3, 9)
    assert rows["a"].token == 7
    plan, _ = step(sched)
    assert {r.seq.session_key: r.pos for r in plan.decode} == {"a": 4, "b": 10}


def test_finishing_on_eos_max_tokens_and_full_context():
    slots, sched = make(max_seq=20)
    stopper, limited, filler = seq("a", 3), seq("b", 3, max_tokens=2), seq("c", 15)
    for s in (stopper, limited, filler):
        sched.add(s)
    _, finished = step(sched, tokens={"a": EOS})
    assert stopper in finished and stopper.finish_reason is FinishReason.STOP and stopper.generated == []
    assert slots.slot(stopper.slot).tokens == [5, 5, 5, 99]
    while not limited.is_finished or not filler.is_finished:
        step(sched)
    assert limited.finish_reason is FinishReason.LENGTH and len(limited.generated) == 2
    assert filler.finish_reason is FinishReason.CONTEXT_FULL
    assert slots.slot(filler.slot).kv_len == 20  # every position used, none beyond
    assert not slots.slot(filler.slot).busy


def test_a_follow_up_turn_prefills_only_its_new_tokens():
    slots, sched = make()
    first = seq("a", 10, max_tokens=3)
    sched.add(first)
    while not first.is_finished:
        step(sched)
    held = len(slots.slot(first.slot).tokens)  # 10 + 3 generated + marker; the last two not yet cached
    assert slots.slot(first.slot).kv_len == held - 2
    nxt = seq("a", 4)
    sched.add(nxt)
    plan, _ = step(sched)
    assert nxt.slot == first.slot and nxt.turn_start == held
    assert plan.prefill[0].start_pos == held - 2 and len(plan.prefill[0].tokens) == 2 + 4


def test_a_sessions_second_request_waits_without_blocking_others():
    _, sched = make()
    a1, a2, b = seq("a", 3, max_tokens=2), seq("a", 3, max_tokens=2), seq("b", 3, max_tokens=2)
    for s in (a1, a2, b):
        sched.add(s)
    plan, _ = step(sched)
    assert {c.seq for c in plan.prefill} == {a1, b} and a2.state is SeqState.WAITING
    step(sched)  # a1 and b finish
    plan, _ = step(sched)
    assert [c.seq for c in plan.prefill] == [a2] and a2.slot == a1.slot


def test_when_every_slot_generates_requests_wait_in_arrival_order():
    slots, sched = make(n_slots=1)
    running, second, third = seq("a", 2, max_tokens=3), seq("b", 2), seq("c", 2)
    sched.add(running)
    step(sched)
    sched.add(second)
    sched.add(third)
    plan, _ = step(sched)
    assert not plan.failed and second.state is SeqState.WAITING and third.state is SeqState.WAITING
    while not running.is_finished:
        step(sched)
    step(sched)
    assert second.state is not SeqState.WAITING and third.state is SeqState.WAITING  # oldest first
    assert slots.lookup("a") is None  # its idle slot was evicted for b
    assert slots.is_lost("a")


def test_reject_policy_fails_requests_with_no_slot():
    _, sched = make(n_slots=1, policy="reject")
    sched.add(seq("a", 2, max_tokens=1))
    step(sched)
    other = seq("b", 2)
    sched.add(other)
    plan, _ = step(sched)
    assert [(s, type(e)) for s, e in plan.failed] == [(other, ResourceUnavailable)]
    assert other.is_finished


def test_a_prompt_that_does_not_fit_is_refused_and_holds_no_slot():
    slots, sched = make(max_seq=10)
    big = seq("a", 11)
    sched.add(big)
    plan, _ = step(sched)
    (failed, error), = plan.failed
    assert failed is big and isinstance(error, InvalidArgument) and error.index == 0
    assert slots.lookup("a") is None and not sched.has_work


def test_deadlines_expire_waiting_and_running_requests_and_roll_back_the_turn():
    slots, sched = make(n_slots=1)
    history = seq("a", 4, max_tokens=2)
    sched.add(history)
    while not history.is_finished:
        step(sched, now=0.0)
    kept = list(slots.slot(0).tokens)
    running = seq("a", 30, deadline=10.0)
    sched.add(running)
    waiting = seq("b", 3, deadline=5.0)
    sched.add(waiting)
    step(sched, now=1.0)
    assert running.state is SeqState.PREFILL
    plan = sched.schedule(now=11.0)
    errors = {s.session_key: type(e) for s, e in plan.failed}
    assert errors == {"a": DeadlineExceeded, "b": DeadlineExceeded}
    slot = slots.slot(0)
    assert slot.owner == "a" and slot.tokens == kept and slot.kv_len <= len(kept) and not slot.busy
    assert not sched.has_work


def test_abort_and_cancel_session():
    slots, sched = make()
    first = seq("a", 5)
    sched.add(first)
    step(sched)
    queued = seq("a", 2)
    sched.add(queued)
    victims = sched.cancel_session("a")
    assert set(victims) == {first, queued} and not sched.has_work
    assert slots.lookup("a") is None  # its only turn was rolled back: nothing left, slot freed
    assert sched.abort(first) is False


def test_paused_scheduler_admits_nobody():
    _, sched = make()
    sched.paused = True
    s = seq("a", 3)
    sched.add(s)
    plan = sched.schedule()
    assert plan.empty and s.state is SeqState.WAITING
    sched.paused = False
    assert not sched.schedule().empty


def test_a_turn_that_adds_no_tokens_is_refused():
    slots, sched = make()
    empty = seq("a", 0)
    sched.add(empty)
    plan = sched.schedule()
    (failed, error), = plan.failed
    assert failed is empty and isinstance(error, InvalidArgument) and plan.empty
    assert slots.lookup("a") is None
