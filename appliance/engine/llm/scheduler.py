"""Continuous batching: what runs in the next engine step (torch-free, tokenizer-free).

Each step: expire requests past their deadline, admit waiting requests to slots (first come first served; a
session's second request waits until its first has finished), give prefilling sequences chunks of at most
`prefill_chunk` tokens (at most `max_prefill_tokens` in all, oldest admission first), and decode every sequence that
is generating. A long prompt therefore delays the decoders by one chunk per step, never by the whole prompt.

What a turn's tokens are and when a reply stops is the caller's `TurnPolicy` (the service owns the tokenizer).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from core.errors import INVALID, OUT_OF_RANGE, ApplianceError, DeadlineExceeded, InvalidArgument, ResourceUnavailable
from appliance.engine.llm.prefix_index import Key, PrefixIndex
from appliance.engine.llm.sequence import FinishReason, Sequence, SeqState
from appliance.engine.llm.speculation import LookupDrafter, ModelDrafter, SpeculationSettings

DRAFT_COST_WARMUP = 4  # drafting steps whose measured cost is left out (kernel set-up on first shapes)
from appliance.engine.llm.slots import Acquired, Slot, SlotManager, SlotMove


class TurnPolicy(Protocol):
    def prepare(self, seq: Sequence, slot: Slot, acquired: Acquired) -> None:
        """Append this turn's tokens (template + prompt) to slot.tokens."""

    def accept(self, seq: Sequence, slot: Slot, token: int) -> FinishReason | None:
        """Take a sampled token: append it to seq.generated and slot.tokens, or finish (returning why)."""

    def close(self, seq: Sequence, slot: Slot) -> None:
        """The reply finished: make the slot's conversation well formed for the next turn."""


@dataclass
class PrefillChunk:
    seq: Sequence
    slot: int
    start_pos: int
    tokens: list[int]
    last: bool  # completes the turn's pending tokens: the row's logits give the first reply token


@dataclass
class DecodeRow:
    seq: Sequence
    slot: int
    pos: int
    token: int
    draft: list[int] = field(default_factory=list)  # speculation: tokens proposed after `token`, verified in this step
    draft_wanted: int = 0  # speculation by a draft model: the engine fills `draft` with this many before the step


@dataclass
class Verified:
    """A speculative row's result: the tokens the reply takes (the first `accepted` are the draft's own, whose
    keys and values this step wrote; a last one past them, if any, was drawn from the target model)."""
    tokens: list[int]
    accepted: int


@dataclass
class PrefixCopy:
    key: Key  # the shared head's tokens
    slot: int  # load: copy the stored KV into positions 0..len(key)-1 of this slot; save: copy them out


@dataclass
class StepPlan:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    failed: list[tuple[Sequence, ApplianceError]] = field(default_factory=list)  # answered without running
    finished: list[Sequence] = field(default_factory=list)  # ended by their finish_at: answered as they are
    prefix_loads: list[PrefixCopy] = field(default_factory=list)  # before the forwards
    prefix_saves: list[PrefixCopy] = field(default_factory=list)  # after the prefill forward
    prefix_drops: list[Key] = field(default_factory=list)  # stored heads the index let go
    slot_moves: list[SlotMove] = field(default_factory=list)  # conversations parked / restored, first of all

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def has_copies(self) -> bool:
        """KV copies to make even when no forward runs (parked or dropped state to free, say)."""
        return bool(self.slot_moves or self.prefix_loads or self.prefix_drops)


class Scheduler:
    def __init__(self, slots: SlotManager, policy: TurnPolicy, prefill_chunk: int = 256,
                 max_prefill_tokens: int | None = None, prefixes: PrefixIndex | None = None,
                 speculation: SpeculationSettings | None = None):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self.slots = slots
        self.policy = policy
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens or prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.paused = False  # admit nobody (a weight swap waits for the running sequences to finish)
        self.prefixes = prefixes if prefixes is not None else PrefixIndex(0)
        self.speculation = speculation if speculation is not None and speculation.enabled else None
        self.draft_cost: float | None = None  # a draft model's forward over a step, as the engine measured them
        self._draft_observations = 0

    def observe_draft_cost(self, forward_s: float, step_s: float) -> None:
        """A step's time and its draft forwards' (per forward), measured by the engine: their ratio, smoothed, is
        what a drafted token costs (speculation.best_draft_length). The first few are left out: a shape's first
        forward sets up its kernels and costs many times a later one."""
        self._draft_observations += 1
        if step_s <= 0 or self._draft_observations <= DRAFT_COST_WARMUP:
            return
        cost = forward_s / step_s
        self.draft_cost = cost if self.draft_cost is None else 0.8 * self.draft_cost + 0.2 * cost

    # -- intake ----------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.state = SeqState.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def active_sessions(self) -> set[str]:
        return {s.session_key for s in self.running}

    # -- planning --------------------------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> StepPlan:
        now = time.monotonic() if now is None else now
        plan = StepPlan()
        for seq in [s for s in self.running if now > s.deadline]:
            self.abort(seq)
            plan.failed.append((seq, DeadlineExceeded("the request's deadline passed")))
        for seq in [s for s in [*self.waiting, *self.running] if now > s.finish_at]:
            self._finish_at_bound(seq, now)
            plan.finished.append(seq)
        self._admit(plan, now)
        budget = self.max_prefill_tokens
        # drafted tokens of the whole step at most one draft's worth: with several sequences the step is no longer
        # bound by reading the weights, and every drafted row costs its share of the output layer
        self._draft_budget = self.speculation.draft_max if self.speculation is not None else 0
        for seq in self.running:
            slot = self.slots.slot(seq.slot)
            pending = len(slot.tokens) - slot.kv_len
            if seq.state is SeqState.DECODE and pending == 1:
                row = DecodeRow(seq, seq.slot, slot.kv_len, slot.tokens[-1])
                self._draft(row, slot)
                plan.decode.append(row)
            elif seq.state is SeqState.DECODE:
                # The sampled token and the stretch a grammar forced after it (jump-forward): fed in one step as a
                # prefill chunk, whose last row gives the next token to sample (outside the prompts' budget: it
                # stands in for the decode row)
                n = min(pending, self.prefill_chunk)
                plan.prefill.append(PrefillChunk(seq, seq.slot, slot.kv_len,
                                                 slot.tokens[slot.kv_len:slot.kv_len + n], n == pending))
            elif budget > 0:
                n = min(pending, self.prefill_chunk, budget)
                budget -= n
                plan.prefill.append(PrefillChunk(seq, seq.slot, slot.kv_len,
                                                 slot.tokens[slot.kv_len:slot.kv_len + n], n == pending))
                key = seq.save_prefix
                if key is not None and slot.kv_len < len(key) <= slot.kv_len + n:  # this chunk completes the head
                    plan.prefix_saves.append(PrefixCopy(key, seq.slot))
        plan.prefix_drops = self.prefixes.take_evicted()
        plan.slot_moves = self.slots.take_moves()
        return plan

    def _draft(self, row: DecodeRow, slot: Slot) -> None:
        """Speculation's proposal for a decoding sequence (nothing when off or nothing matches): at most what the
        reply and the context still have room for past the token the step samples anyway. A lookup draft is made
        here; a draft model's is only sized (row.draft_wanted: the engine runs that model before the step)."""
        if self.speculation is None:
            return
        seq = row.seq
        if seq.drafter is None:
            seq.drafter = (ModelDrafter if self.speculation.mode == "draft" else LookupDrafter)(self.speculation)
        room = min(seq.max_tokens - len(seq.generated) - 1, self.slots.max_seq_len - 1 - slot.kv_len,
                   self._draft_budget)
        if room <= 0:
            return
        if isinstance(seq.drafter, ModelDrafter):
            row.draft_wanted = seq.drafter.wanted_at_cost(room, self.draft_cost, len(self.running))
            self._draft_budget -= row.draft_wanted
        else:
            row.draft = seq.drafter.propose(slot.tokens, room)
            self._draft_budget -= len(row.draft)

    def _admit(self, plan: StepPlan, now: float) -> None:
        if self.paused:
            for seq in [s for s in self.waiting if now > s.deadline]:
                self.waiting.remove(seq)
                seq.state = SeqState.FINISHED
                plan.failed.append((seq, DeadlineExceeded("the request's deadline passed")))
            return
        busy_sessions = self.active_sessions()
        still_waiting: deque[Sequence] = deque()
        while self.waiting:
            seq = self.waiting.popleft()
            if now > seq.deadline:
                seq.state = SeqState.FINISHED
                plan.failed.append((seq, DeadlineExceeded("the request's deadline passed")))
                continue
            if seq.session_key in busy_sessions:  # never two sequences in one slot: wait for the first
                still_waiting.append(seq)
                continue
            acquired = self.slots.acquire(seq.session_key)
            if acquired is None:
                if self.slots.policy == "reject":
                    seq.state = SeqState.FINISHED
                    plan.failed.append((seq, ResourceUnavailable("no KV-cache slot is free")))
                else:  # evict_lru with every slot generating: wait for one to go idle
                    still_waiting.append(seq)
                continue
            slot = self.slots.slot(acquired.slot)
            seq.slot = acquired.slot
            seq.context_lost = acquired.context_lost
            seq.turn_start = len(slot.tokens)
            try:
                self.policy.prepare(seq, slot, acquired)
                if len(slot.tokens) == slot.kv_len:  # nothing to run: no logits to sample a reply from
                    raise InvalidArgument("the prompt adds no tokens", 0, INVALID)
                if len(slot.tokens) > self.slots.max_seq_len:
                    raise InvalidArgument("the prompt does not fit the model's context; call ResetContext or "
                                          "send a shorter prompt", 0, OUT_OF_RANGE)
            except ApplianceError as exc:
                self._roll_back(seq)
                seq.state = SeqState.FINISHED
                plan.failed.append((seq, exc))
                continue
            seq.prompt_tokens = len(slot.tokens) - seq.turn_start
            if slot.kv_len == 0 and seq.shared_prefix < len(slot.tokens):  # a first turn: share its head
                key = self.prefixes.lookup(slot.tokens, seq.shared_prefix)
                if key is not None:
                    plan.prefix_loads.append(PrefixCopy(key, seq.slot))
                    slot.kv_len = len(key)
                else:
                    seq.save_prefix = self.prefixes.wanted(slot.tokens, seq.shared_prefix)
            seq.admitted_at = now
            seq.state = SeqState.PREFILL
            self.slots.set_busy(seq.slot, True)
            self.running.append(seq)
            busy_sessions.add(seq.session_key)
        self.waiting = still_waiting

    # -- results ---------------------------------------------------------------------------------------------
    def commit(self, plan: StepPlan, sampled: dict[int, int | Verified], now: float | None = None) -> list[Sequence]:
        """Record a step's effect: chunks written, one token sampled per row that produced logits (request_id ->
        token; a speculative row's Verified tokens). Returns the sequences that finished."""
        now = time.monotonic() if now is None else now
        finished: list[Sequence] = []
        for copy in plan.prefix_saves:  # the forward that wrote them succeeded: the heads are stored
            self.prefixes.add(copy.key)
        for chunk in plan.prefill:
            if chunk.seq.state is SeqState.FINISHED:
                continue
            self.slots.slot(chunk.slot).kv_len += len(chunk.tokens)
            if chunk.last:
                chunk.seq.state = SeqState.DECODE
                self._take(chunk.seq, sampled[chunk.seq.request_id], now, finished)
        for row in plan.decode:
            if row.seq.state is SeqState.FINISHED:
                continue
            self.slots.slot(row.slot).kv_len += 1
            result = sampled[row.seq.request_id]
            if isinstance(result, Verified):
                self._take_verified(row, result, now, finished)
            else:
                self._take(row.seq, result, now, finished)
        return finished

    def _take_verified(self, row: DecodeRow, result: Verified, now: float, finished: list[Sequence]) -> None:
        """A speculative row's tokens, one by one as plain steps would take them. The draft's keys and values past
        the row's token count only as far as the reply took exactly the drafted tokens; the rest of the cache is
        stale and the slot's length leaves it out (the next step overwrites it)."""
        seq, slot = row.seq, self.slots.slot(row.slot)
        if seq.drafter is not None:
            seq.drafter.record(len(row.draft), result.accepted)
        for i, token in enumerate(result.tokens):
            if i > 0:  # the previous token was the draft's, at position kv_len: its cache entry stands
                slot.kv_len += 1
            before = len(slot.tokens)
            self._take(seq, token, now, finished)
            if seq.state is SeqState.FINISHED or i >= result.accepted or len(slot.tokens) != before + 1:
                return  # finished, a drawn token (not in the cache), or a grammar's forced stretch followed it

    def _take(self, seq: Sequence, token: int, now: float, finished: list[Sequence]) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = now
        slot = self.slots.slot(seq.slot)
        reason = self.policy.accept(seq, slot, token)
        if reason is None and len(slot.tokens) - 1 >= self.slots.max_seq_len:
            reason = FinishReason.CONTEXT_FULL  # the next token would have no cache position
        if reason is not None:
            seq.finish_reason = reason
            self.policy.close(seq, slot)
            self._retire(seq, now)
            finished.append(seq)

    # -- ending early ----------------------------------------------------------------------------------------
    def _finish_at_bound(self, seq: Sequence, now: float) -> None:
        """A job's run reached its bound: a reply being generated ends with what it has (its turn stays in the
        conversation, as at MaxTokens); one still queued or prefilling ends empty, its turn rolled back."""
        seq.finish_reason = FinishReason.DEADLINE
        if seq.state is SeqState.DECODE:
            self.policy.close(seq, self.slots.slot(seq.slot))
            self._retire(seq, now)
        else:
            self.abort(seq)

    def abort(self, seq: Sequence) -> bool:
        """Cancel a sequence (deadline, client gone, engine failure): the slot rolls back to before this turn and
        stays with its session. False if it was no longer queued or running."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self._roll_back(seq)
        else:
            return False
        self._retire(seq, time.monotonic())
        return True

    def cancel_session(self, session: str) -> list[Sequence]:
        """Abort every sequence of a session (it closed). Returns them so the caller can answer them."""
        victims = [s for s in list(self.waiting) + self.running if s.session_key == session]
        for seq in victims:
            self.abort(seq)
        return victims

    def abort_all(self) -> list[Sequence]:
        victims = list(self.waiting) + list(self.running)
        for seq in victims:
            self.abort(seq)
        return victims

    def _roll_back(self, seq: Sequence) -> None:
        if seq.slot is None:
            return
        self.slots.truncate(seq.slot, seq.turn_start)
        if seq.turn_start == 0:  # nothing of this session's in the slot: give it back
            self.slots.release(seq.session_key)

    def _retire(self, seq: Sequence, now: float) -> None:
        if seq in self.running:
            self.running.remove(seq)
            if seq.slot is not None and self.slots.slot(seq.slot).owner == seq.session_key:
                self.slots.set_busy(seq.slot, False)
                if seq.one_shot:  # no conversation goes on from this turn: the slot is free for others
                    self.slots.release(seq.session_key)
        seq.state = SeqState.FINISHED
        seq.finished_at = now
