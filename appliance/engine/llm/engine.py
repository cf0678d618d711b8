"""The engine thread of one generative model: the only code that touches its scheduler, slots and model.

The event loop talks to it through a thread-safe command queue (submit, cancel, release, swap, stop); answers go
back through each request's Reply (`loop.call_soon_threadsafe`). The thread publishes plain int counters (running
sequences, slots in use) that the event loop reads without a lock.
"""
from __future__ import annotations

import logging
import queue
import time
from pathlib import Path
from typing import Any

from appliance.engine.llm.chat_turns import ChatTurns
from appliance.engine.llm.choose import ChooseRequest, best
from appliance.engine.liveness import Liveness
from appliance.engine.llm.loading import LoadedEngine
from appliance.engine.llm.settings import GenerativeSettings
from appliance.engine.llm.prefix_index import PrefixIndex
from appliance.engine.llm.scheduler import Scheduler, StepPlan, Verified
from appliance.engine.llm.sequence import Sequence
from appliance.engine.llm.slots import SlotManager
from appliance.engine.llm.speculation import SpeculationSettings
from appliance.engine.llm.thread_reply import Reply
from core.errors import (OUT_OF_RANGE, ApplianceError, DeadlineExceeded, EngineFailure, InvalidArgument,
                             NotReady, ResourceUnavailable)
from appliance.metrics import Metrics
from core.model_port import ChooseResult, GenerateResult

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02  # how often a blocked engine re-checks queued requests' deadlines


def park_tokens(cache: Any, memory_mb: int) -> int:
    """KV positions `memory_mb` of host memory holds for parked conversations (all layers' keys and values)."""
    _two, layers, _slots, kv_heads, _positions, head_dim = cache.kv.shape
    per_token = 2 * layers * kv_heads * head_dim * cache.kv.element_size()
    return memory_mb * 2**20 // per_token


class EngineLoop:
    """Runs (in `run`, the body of the engine thread) the scheduler's steps on the loaded model."""

    def __init__(self, name: str, settings: GenerativeSettings, *, metrics: Metrics | None, liveness: Liveness):
        self.name = name
        self.settings = settings
        self.metrics = metrics
        self.liveness = liveness
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._chooses: list[ChooseRequest] = []  # waiting for the engine thread (a slot)
        # Published by the engine thread (plain ints: reads from the event loop need no lock).
        self._running = 0
        self._slots_in_use = 0
        self._conversations_parked = 0
        self._slots_total_published = 0
        self._slots_used_published = 0

    # ---- what the event loop calls (any thread) -------------------------------------------------------------
    @property
    def running(self) -> int:
        """Sequences admitted to the batch (the rest of the accepted calls wait)."""
        return self._running

    @property
    def slots_in_use(self) -> int:
        return self._slots_in_use

    @property
    def conversations_parked(self) -> int:
        """Evicted conversations held in host memory until their session's next call."""
        return self._conversations_parked

    def step_counts(self) -> tuple[int, float, int]:
        """(engine steps run, seconds spent on token masks, rows masked) since the weights loaded (benchmarks)."""
        runner = getattr(self, "_runner", None)
        return (runner.steps, runner.mask_seconds, runner.mask_rows) if runner is not None else (0, 0.0, 0)

    def speculation_counts(self) -> tuple[int, int, int]:
        """(rows verified, tokens drafted, drafted tokens accepted) since the weights loaded (benchmarks)."""
        runner = getattr(self, "_runner", None)
        return (runner.verify_rows, runner.drafted, runner.accepted) if runner is not None else (0, 0, 0)

    def draft_counts(self) -> tuple[int, float]:
        """(forwards the draft model ran, seconds they took) since the weights loaded (speculation: draft;
        benchmarks)."""
        draft = getattr(self, "_draft", None)
        return (draft.forwards, draft.seconds) if draft is not None else (0, 0.0)

    def submit(self, seq: Sequence) -> None:
        """Queue a request; seq.handle (a Reply) gets its GenerateResult or error."""
        self._commands.put(("submit", seq))

    def choose(self, request: ChooseRequest) -> None:
        """Queue a Choose; request.handle (a Reply) gets its ChooseResult or error."""
        self._commands.put(("choose", request))

    def cancel(self, seq: Sequence) -> None:
        """The caller gave up (deadline, cancellation): roll the slot back to before this turn."""
        self._commands.put(("cancel", seq))

    def release(self, session_key: str, reply: Reply | None = None) -> None:
        """Cancel the session's calls and free its slot; reply (if any) is sent once the slot is free."""
        self._commands.put(("release", session_key) if reply is None else ("release", session_key, reply))

    def swap(self, engine: LoadedEngine, reply: Reply) -> None:
        """Serve new weights once the running sequences finish; reply is sent after the swap."""
        self._commands.put(("swap", engine, reply))

    def stop(self, reply: Reply) -> None:
        """Answer every waiting and running request NotReady, free all slots, end `run`."""
        self._commands.put(("stop", None, reply))

    # ---- the engine thread ---------------------------------------------------------------------------------
    def run(self, engine: LoadedEngine) -> None:
        from appliance.engine.llm.runner import ModelRunner

        s = self.settings
        if s.threads > 0:
            import torch
            torch.set_num_threads(s.threads)
        self._files = None
        if s.conversation_dir:
            from appliance.engine.llm.conversation_files import ConversationFiles
            self._files = ConversationFiles(Path(s.conversation_dir), s.conversation_ttl_s)
        self._slots = SlotManager(s.kv_slots, engine.max_seq_len, s.slot_policy,
                                  park_tokens=park_tokens(engine.cache, s.park_memory_mb),
                                  recall=self._files.recall if self._files else None)
        if self._files is not None:
            for session in self._files.expired:  # ended by the TTL while the appliance was down
                self._slots.mark_lost(session)
        self._turns = ChatTurns(engine.tokenizer, s.system_prompt, s.max_text_chars, engine.max_seq_len,
                                jump_forward=s.jump_forward)
        self._runner = ModelRunner(engine.model, engine.cache, compiled=engine.compiled_decode)
        speculation = SpeculationSettings(s.speculation, s.speculation_draft_min, s.speculation_draft_max)
        if speculation.enabled and self._runner.graphs:
            log.warning("model %s: speculation is verified by the eager forward only; off on this device", self.name)
            speculation = None
        elif speculation.mode == "draft" and engine.draft is None:  # loading.load_draft refuses rather than this
            log.warning("model %s: no draft model loaded; speculation off", self.name)
            speculation = None
        self._draft = engine.draft if speculation is not None else None
        self._scheduler = Scheduler(self._slots, self._turns, s.prefill_chunk,
                                    prefixes=PrefixIndex(s.prefix_cache_entries), speculation=speculation)
        self._live_engine = engine
        self._pending_swap: tuple[LoadedEngine, Reply] | None = None
        self._exit = False
        self._publish_slots()
        while not self._exit:
            try:
                self._engine_iteration()
            except Exception:  # the thread must survive anything; requests of a failed step are answered there
                log.exception("model %s: engine loop error", self.name)
                time.sleep(IDLE_POLL_S)
        self._publish_slots(total=0)

    def _engine_iteration(self) -> None:
        sched = self._scheduler
        self._drain_commands(block=not sched.has_work and self._pending_swap is None and not self._chooses)
        if self._exit:
            return
        with self.liveness.busy():  # scheduling tokenizes prompts: a template stuck in a loop counts too
            if self._pending_swap is not None and not sched.running:
                self._swap()
            if self._chooses and self._pending_swap is None:
                self._run_chooses()
            plan = sched.schedule()
            for seq, error in plan.failed:
                self._answer(seq, error=error)
            for seq in plan.finished:
                self._finished(seq)
            self._running = len(sched.running)
            if not plan.empty:
                self._step(plan)
                self._running = len(sched.running)
            elif plan.has_copies:
                self._runner.run(plan)  # parks, restores and frees with no forward to run
        if plan.empty and (sched.has_work or self._pending_swap is not None or self._chooses):
            self._drain_commands(block=True, timeout=IDLE_POLL_S)
        self._publish_slots()

    def _step(self, plan: StepPlan) -> None:
        try:
            if self._draft is not None:  # speculation: draft: the draft model proposes the rows' drafts first
                forwards, seconds = self._draft.token_forwards, self._draft.token_seconds
                self._draft.fill(plan, self._slots)
                forwards, seconds = self._draft.token_forwards - forwards, self._draft.token_seconds - seconds
                started = time.perf_counter()
            sampled = self._runner.run(plan)
            if self._draft is not None and forwards and plan.decode:  # what a drafted token costs, as measured
                self._scheduler.observe_draft_cost(seconds / forwards, time.perf_counter() - started)
            finished = self._scheduler.commit(plan, sampled)
        except Exception:  # the step's sequences fail, their slots roll back to before their turn; others go on
            log.exception("model %s: engine step failed", self.name)
            for seq in {id(r.seq): r.seq for r in [*plan.prefill, *plan.decode]}.values():
                if self._scheduler.abort(seq):
                    self._answer(seq, error=EngineFailure("the engine failed on this request"))
                elif seq.finish_reason is not None:  # finished before the failure: its answer stands
                    self._answer_result(seq)
            return
        m = self.metrics
        if m is not None:
            prompt_tokens = sum(len(c.tokens) for c in plan.prefill)
            if prompt_tokens:
                m.tokens_total.labels(self.name, "prompt").inc(prompt_tokens)
            if plan.prefix_loads:
                m.prefix_cache_hits_total.labels(self.name).inc(len(plan.prefix_loads))
            if sampled:
                m.tokens_total.labels(self.name, "generated").inc(
                    sum(len(v.tokens) if isinstance(v, Verified) else 1 for v in sampled.values()))
            if plan.decode:
                m.batch_size.labels(self.name).observe(len(plan.decode))
            for c in plan.prefill:
                if c.last and c.seq.first_token_at is not None:
                    m.time_to_first_token.labels(self.name).observe(c.seq.first_token_at - c.seq.arrival)
            for seq in finished:
                m.queue_wait.labels(self.name).observe(seq.admitted_at - seq.arrival)
        if finished:
            self._publish_slots()  # before the answers: a one-shot turn's slot is free when its caller reads
        for seq in finished:
            self._finished(seq)
        done = {id(seq) for seq in finished}
        for seq in {id(r.seq): r.seq for r in plan.decode}.values():  # replies that grew and go on
            if id(seq) not in done and seq.handle is not None:
                seq.handle.send_progress(seq.text, len(seq.generated))

    def _run_chooses(self) -> None:
        """Each queued Choose that can have a slot now, run to its answer (between two steps)."""
        waiting = []
        now = time.monotonic()
        for request in self._chooses:
            if request.handle.future.done():  # the caller stopped waiting
                continue
            if now > request.deadline:
                request.handle.send(error=DeadlineExceeded("the request's deadline passed"))
                continue
            slots = self._choose_slots(request)
            if not slots and self._slots.policy == "reject":
                request.handle.send(error=ResourceUnavailable("no KV-cache slot is free"))
                continue
            if not slots:
                waiting.append(request)  # every slot is generating: after the next step
                continue
            try:
                result = self._score(request, slots)
            except ApplianceError as exc:
                request.handle.send(error=exc)
            except Exception:  # noqa: BLE001 - a bug of this request's forward: answered, the engine goes on
                log.exception("model %s: Choose failed", self.name)
                request.handle.send(error=EngineFailure("the engine failed on this request"))
            else:
                request.handle.send(result)
            finally:
                for i in range(len(slots)):
                    self._slots.release(request.slot_key(i))
        self._chooses = waiting

    def _choose_slots(self, request: ChooseRequest) -> list[int]:
        """Slots for a Choose: one as a turn would get it (an idle conversation may be parked for it), then as
        many free ones as it has options. [] when none can be had now."""
        first = self._slots.acquire(request.slot_key(0))
        if first is None:
            return []
        got = [first.slot]
        while len(got) < len(request.options) and any(s.owner is None for s in self._slots.slots):
            got.append(self._slots.acquire(request.slot_key(len(got))).slot)
        moves = self._slots.take_moves()
        if moves:  # a conversation parked out of the first slot before it is written
            self._runner.run(StepPlan(slot_moves=moves))
        return got

    def _score(self, request: ChooseRequest, slots: list[int]) -> ChooseResult:
        tokenizer = self._turns.tokenizer
        try:
            prompt, _head = tokenizer.turn_tokens_and_head([], request.prompt, self.settings.system_prompt)
        except Exception as exc:  # a template that cannot render this prompt
            log.warning("chat template failed: %r", exc)
            raise EngineFailure("the model's chat template could not render this prompt") from None
        options = [tokenizer.encode_literal(o) for o in request.options]
        for i, ids in enumerate(options):
            if not ids:
                raise InvalidArgument(f"Options[{i}] has no tokens", 1, OUT_OF_RANGE)
        if len(prompt) + max(map(len, options)) > self._slots.max_seq_len:
            raise InvalidArgument("the prompt and the longest option do not fit the model's context", 0,
                                  OUT_OF_RANGE)
        scores = self._runner.score_options(prompt, options, slots)
        return ChooseResult(best(scores), scores, self._live_engine.version)

    def _finished(self, seq: Sequence) -> None:
        """A reply that ended (stop, length, context full, or a job's bound): its turn saved, then answered."""
        if self._files is not None and seq.slot is not None:  # before the answer: a worker killed after it
            slot = self._slots.slot(seq.slot)                   # still has this turn
            if slot.owner == seq.session_key:
                self._files.save(seq.session_key, slot.tokens, slot.history)
        self._answer_result(seq)

    def _answer_result(self, seq: Sequence) -> None:
        slot = self._slots.slot(seq.slot) if seq.slot is not None else None
        context = len(slot.tokens) if slot is not None and slot.owner == seq.session_key else 0
        self._answer(seq, GenerateResult(seq.text, len(seq.generated), seq.finish_reason.value, context,
                                         seq.context_lost, self._live_engine.version))

    def _drain_commands(self, block: bool, timeout: float | None = None) -> None:
        try:
            item = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "submit":
            self._scheduler.add(item[1])
        elif kind == "choose":
            self._chooses.append(item[1])
        elif kind == "cancel":
            seq = item[1]
            if self._scheduler.abort(seq):
                self._answer(seq, error=DeadlineExceeded("the request was cancelled"))
        elif kind == "release":
            session = item[1]
            for seq in self._scheduler.cancel_session(session):
                self._answer(seq, error=NotReady("the session closed"))
            self._slots.release(session)
            if self._files is not None and self._files.forget(session) and len(item) == 2:
                # a conversation released without a caller waiting: the serve process's conversation TTL ended
                # it (EndConversation waits for its reply), so its next call says ContextLost
                self._slots.mark_lost(session)
            self._publish_slots()  # before the reply: a caller reading SlotsInUse next sees the slot free
            if len(item) > 2:
                item[2].send(None)
        elif kind == "swap":
            self._pending_swap = (item[1], item[2])
            self._scheduler.paused = True  # running sequences finish on the old weights first
        elif kind == "stop":
            for seq in self._scheduler.abort_all():
                self._answer(seq, error=NotReady(f"model {self.name} stopped"))
            for request in self._chooses:
                request.handle.send(error=NotReady(f"model {self.name} stopped"))
            self._chooses = []
            self._slots.drop_all()
            self._exit = True
            item[2].send(None)

    def _swap(self) -> None:
        engine, reply = self._pending_swap
        self._pending_swap = None
        lost = self._slots.drop_all()  # caches computed by the old weights are meaningless now
        if self._files is not None:
            self._files.forget_all()
        if engine.max_seq_len != self._slots.max_seq_len:
            self._slots.max_seq_len = engine.max_seq_len
        self._turns = ChatTurns(engine.tokenizer, self.settings.system_prompt, self.settings.max_text_chars,
                                engine.max_seq_len, jump_forward=self.settings.jump_forward)
        self._scheduler.policy = self._turns
        self._scheduler.prefixes.clear()  # heads computed by the old weights
        self._scheduler.prefixes.take_evicted()  # the new runner starts without them
        from appliance.engine.llm.runner import ModelRunner
        self._runner = ModelRunner(engine.model, engine.cache, compiled=engine.compiled_decode)
        if self._scheduler.speculation is not None and self._scheduler.speculation.mode == "draft":
            self._draft = engine.draft  # loaded with the new weights (its slots start empty)
        self._live_engine = engine
        self._scheduler.paused = False
        log.info("model %s: weights swapped, %d conversations dropped", self.name, len(lost))
        reply.send(None)

    def _answer(self, seq: Sequence, value: Any = None, error: BaseException | None = None) -> None:
        self._runner.forget(seq)
        if seq.handle is not None:
            seq.handle.send(value, error)

    # ---- publishing ----------------------------------------------------------------------------------------
    def _publish_slots(self, total: int | None = None) -> None:
        total = self.settings.kv_slots if total is None else total
        used = self._slots.in_use if total else 0
        self._slots_in_use = used
        self._conversations_parked = self._slots.parked if total else 0
        if self.metrics is not None:  # deltas: several generative models share the two gauges
            self.metrics.kv_slots_total.inc(total - self._slots_total_published)
            self.metrics.kv_slots_used.inc(used - self._slots_used_published)
        self._slots_total_published, self._slots_used_published = total, used
