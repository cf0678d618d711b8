"""One served generative model: what the OPC UA layer calls for `Generate` and `ResetContext`.

An asyncio facade over ONE engine thread. The thread owns the scheduler, the slots and the model, and is the only
code that touches them; requests and commands cross to it through a thread-safe queue, answers come back with
`loop.call_soon_threadsafe`. The event loop never runs a forward pass.

Per session, calls run in arrival order (an asyncio lock per session): a second Generate of a session waits for the
first, a ResetContext waits for the Generate before it. Deadlines are `time.monotonic()` seconds.
Weights load in a short-lived thread, never in a pooled one (see _in_fresh_thread: an idle OpenMP team in another
long-lived thread makes the engine's matmuls ~50% slower on a 2-core CPU).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from appliance.engine.sampling import request_seed
from appliance.engine.scheduler import Scheduler, StepPlan
from appliance.engine.sequence import FinishReason, Sequence
from appliance.engine.slots import POLICIES, Acquired, Slot, SlotManager
from appliance.errors import (INVALID, OUT_OF_RANGE, ApplianceError, DeadlineExceeded, EngineFailure, InvalidArgument, NotReady,
                              ResourceUnavailable)
from appliance.engine.liveness import Liveness
from appliance.engine.llm_settings import DTYPES, MAX_PROMPT_BYTES, MAX_TEMPERATURE, MEMORY_HEADROOM, GenerativeSettings
from appliance.model_port import GenerateResult
from appliance.engine.model_status import ModelStatus
from appliance.metrics import Metrics

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02  # how often a blocked engine re-checks queued requests' deadlines


@dataclass
class _Engine:
    """What one load produced; swapped whole by a reload."""
    model: Any  # models.llama.LlamaModel
    cache: Any  # models.llama.KVCache
    tokenizer: Any  # models.tokenizer.ChatTokenizer
    version: str
    backend: str
    max_seq_len: int


class ChatTurns:
    """The TurnPolicy of chat conversations: template tokens per turn, stop rules, the assistant suffix."""

    def __init__(self, tokenizer: Any, system_prompt: str | None, max_text_chars: int, max_seq_len: int):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.max_text_chars = max_text_chars
        self.max_seq_len = max_seq_len
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.suffix = list(tokenizer.assistant_suffix_tokens())

    def prepare(self, seq: Sequence, slot: Slot, acquired: Acquired) -> None:
        try:
            ids = self.tokenizer.turn_tokens(slot.history, seq.prompt, self.system_prompt)
        except Exception as exc:  # a template that cannot render this conversation
            log.warning("chat template failed: %r", exc)
            raise EngineFailure("the model's chat template could not render this conversation") from None
        slot.tokens.extend(ids)

    def accept(self, seq: Sequence, slot: Slot, token: int) -> FinishReason | None:
        if token in self.eos_ids:
            return FinishReason.STOP
        text = self.tokenizer.decode(seq.generated + [token])
        if len(text) > self.max_text_chars:  # stop before the text would exceed what the PLC can hold
            return FinishReason.LENGTH
        seq.generated.append(token)
        slot.tokens.append(token)
        seq.text = text
        return FinishReason.LENGTH if len(seq.generated) >= seq.max_tokens else None

    def close(self, seq: Sequence, slot: Slot) -> None:
        # The end-of-turn marker the template writes after a reply (the sampled EOS itself was not kept), so the
        # next turn's template tokens follow a well-formed conversation.
        if len(slot.tokens) + len(self.suffix) <= self.max_seq_len:
            slot.tokens.extend(self.suffix)
        slot.history += [{"role": "user", "content": seq.prompt}, {"role": "assistant", "content": seq.text}]


@dataclass
class _Reply:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def send(self, value: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(value)
        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


class GenerativeModelService(ModelStatus):
    kind = "generative"

    def __init__(self, name: str, path: Path, settings: GenerativeSettings, *, version_label: str | None = None,
                 metrics: Metrics | None = None, on_event: Callable[[str, str], None] | None = None,
                 liveness: Liveness | None = None):
        super().__init__(name, path, version_label=version_label, metrics=metrics, on_event=on_event)
        self.settings = settings
        self.liveness = liveness or Liveness()
        self._engine: _Engine | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._session_locks: dict[str, list] = {}  # session -> [asyncio.Lock, users]
        self._request_counter = 0
        self._outstanding = 0  # Generate calls accepted and not yet answered
        # Published by the engine thread (plain ints: reads from the event loop need no lock).
        self._running = 0
        self._slots_in_use = 0
        self._slots_total_published = 0
        self._slots_used_published = 0

    # ---- what the address space shows ----------------------------------------------------------------------
    @property
    def version(self) -> str:
        return self._engine.version if self._engine else ""

    @property
    def backend_name(self) -> str:
        return self._engine.backend if self._engine else ""

    @property
    def slots_total(self) -> int:
        return self.settings.kv_slots if self._engine else 0

    @property
    def slots_in_use(self) -> int:
        return self._slots_in_use

    @property
    def queue_depth(self) -> int:
        return max(0, self._outstanding - self._running)

    @property
    def engine_alive(self) -> bool:
        """The engine thread runs (for the heartbeat and /readyz)."""
        return self._thread is not None and self._thread.is_alive()

    # ---- life cycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the weights and allocate the cache (in a thread), start the engine thread. Ends Ready or Failed;
        never raises."""
        async with self._reload_lock:
            self._set_state("Loading")
            try:
                engine = await _in_fresh_thread(self._load, None)
            except Exception as exc:
                self._load_failed(_reason(exc))
                return
            self._engine = engine
            self._thread = threading.Thread(target=self._engine_main, args=(engine,), name=f"llm-{self.name}",
                                            daemon=True)
            self._thread.start()
            self.failure_reason = None
            self._publish_loaded()
            self._set_state("Ready")

    async def reload(self) -> str:
        """New weights from the same path. Sequences running finish on the old weights; then every session's
        conversation is dropped (ContextLost on its next call). A failed load keeps the old weights serving."""
        async with self._reload_lock:
            if self._stopped:
                raise NotReady("the model is stopped")
            try:
                engine = await _in_fresh_thread(self._load, self._engine)
            except Exception as exc:
                reason = _reason(exc)
                log.error("model %s reload failed: %s", self.name, reason)
                if self._engine is None:
                    self.failure_reason = reason
                self._emit("ModelReloadFailed", reason)
                raise EngineFailure(f"reload failed: {reason}") from None
            if self._thread is None:  # the first load had failed: start serving now
                self._engine = engine
                self._thread = threading.Thread(target=self._engine_main, args=(engine,),
                                                name=f"llm-{self.name}", daemon=True)
                self._thread.start()
            else:
                await self._call_engine("swap", engine)
                self._engine = engine
            self.failure_reason = None
            self._publish_loaded()
            self._set_state("Ready")
            log.info("model %s now serves version %s on %s", self.name, engine.version, engine.backend)
            return engine.version

    async def stop(self) -> None:
        """Answer every waiting and running request NotReady, free all slots, end the engine thread."""
        self._stopped = True
        if self._thread is not None and self._thread.is_alive():
            await self._call_engine("stop", None)
            await asyncio.to_thread(self._thread.join, 10.0)
        self._thread = None
        if self.metrics is not None:
            self.metrics.model_ready.labels(self.name).set(0)

    # ---- requests ------------------------------------------------------------------------------------------
    async def generate(self, session_key: str, prompt: str, max_tokens: int, temperature: float,
                       deadline: float) -> GenerateResult:
        started = time.monotonic()
        self.request_count += 1
        try:
            result = await self._generate(session_key, prompt, max_tokens, temperature, deadline)
        except BaseException:  # a cancelled call (client gone) counts too: the model did not answer it
            self.error_count += 1
            raise
        self.last_latency_ms = (time.monotonic() - started) * 1000.0
        return result

    async def _generate(self, session_key: str, prompt: str, max_tokens: int, temperature: float,
                        deadline: float) -> GenerateResult:
        self._validate(prompt, max_tokens, temperature)
        self._require_ready()
        if self.queue_depth >= self.settings.max_queue_size:
            raise ResourceUnavailable("the model's queue is full")
        self._outstanding += 1
        self._publish_queue()
        try:
            async with self._session_turn(session_key, deadline):
                self._require_ready()
                self._request_counter += 1
                seq = Sequence(session_key=session_key, prompt=prompt, max_tokens=int(max_tokens),
                               temperature=float(temperature), top_p=self.settings.top_p,
                               seed=request_seed(self.settings.seed, self._request_counter), deadline=deadline)
                loop = asyncio.get_running_loop()
                seq.handle = _Reply(loop, loop.create_future())
                self._commands.put(("submit", seq))
                try:
                    done, _ = await asyncio.wait({seq.handle.future}, timeout=max(0.0, deadline - time.monotonic()))
                except asyncio.CancelledError:
                    self._commands.put(("cancel", seq))
                    seq.handle.future.cancel()  # nobody will read the engine's answer
                    raise
                if not done:
                    self._commands.put(("cancel", seq))  # the engine rolls the slot back to before this turn
                    seq.handle.future.cancel()
                    raise DeadlineExceeded("the request's deadline passed")
                return seq.handle.future.result()
        finally:
            self._outstanding -= 1
            self._publish_queue()

    async def reset(self, session_key: str) -> None:
        """Forget the session's conversation and give its slot back (after its earlier calls)."""
        self._require_ready()
        async with self._session_turn(session_key, math.inf):
            await self._call_engine("release", session_key)

    def release(self, session_key: str) -> None:
        """The session closed or timed out: cancel its calls, free its slot. Thread-safe, idempotent."""
        if self._thread is not None:
            self._commands.put(("release", session_key))

    # ---- event-loop helpers --------------------------------------------------------------------------------
    def _validate(self, prompt: Any, max_tokens: Any, temperature: Any) -> None:
        if not isinstance(prompt, str) or not prompt:
            raise InvalidArgument("Prompt must be a non-empty string", 0, INVALID)
        try:
            size = len(prompt.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidArgument("Prompt is not valid UTF-8", 0, INVALID) from None
        if size > MAX_PROMPT_BYTES:
            raise InvalidArgument(f"Prompt is {size} bytes; at most {MAX_PROMPT_BYTES} are allowed", 0,
                                  OUT_OF_RANGE)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) \
                or not 1 <= max_tokens <= self.settings.max_new_tokens:
            raise InvalidArgument(f"MaxTokens must be between 1 and {self.settings.max_new_tokens}", 1,
                                  OUT_OF_RANGE)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or math.isnan(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise InvalidArgument(f"Temperature must be between 0 and {MAX_TEMPERATURE:g}", 2, OUT_OF_RANGE)

    def _require_ready(self) -> None:
        if self._stopped or self.state != "Ready" or self._engine is None:
            raise NotReady(f"model {self.name} is not Ready")

    @contextlib.asynccontextmanager
    async def _session_turn(self, session_key: str, deadline: float):
        entry = self._session_locks.setdefault(session_key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceeded("the request's deadline passed")
            try:
                async with asyncio.timeout(None if math.isinf(timeout) else timeout):
                    await entry[0].acquire()
            except TimeoutError:
                raise DeadlineExceeded("the request's deadline passed while an earlier call of the session "
                                       "ran") from None
            try:
                yield
            finally:
                entry[0].release()
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                self._session_locks.pop(session_key, None)

    async def _call_engine(self, command: str, arg: Any) -> Any:
        loop = asyncio.get_running_loop()
        reply = _Reply(loop, loop.create_future())
        self._commands.put((command, arg, reply))
        return await reply.future

    # ---- loading (worker thread) ---------------------------------------------------------------------------
    def _load(self, current: _Engine | None) -> _Engine:
        import torch

        from models.llama import KVCache, LlamaModel
        from models.weights import load_weights

        s = self.settings
        if s.slot_policy not in POLICIES:
            raise EngineFailure(f"slot_policy must be one of {', '.join(POLICIES)}")
        if s.dtype not in DTYPES:
            raise EngineFailure(f"dtype must be one of {', '.join(DTYPES)}")
        if min(s.kv_slots, s.max_seq_len, s.max_new_tokens, s.prefill_chunk, s.max_text_chars) < 1:
            raise EngineFailure("kv_slots, max_seq_len, max_new_tokens, prefill_chunk and max_text_chars must be "
                                "positive")
        device = s.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineFailure("device cuda was asked for but no GPU is available")
        # fp32 on CPU: greedy output stays that of the reference (bf16 diverges within a few tokens) and batch-1
        # decode is no faster in bf16 here; see bench/generate.py.
        dtype_name = s.dtype if s.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
        dtype = getattr(torch, dtype_name)
        if s.threads > 0:
            torch.set_num_threads(s.threads)

        loaded = load_weights(self.path, dtype)
        config = loaded.config
        max_seq_len = s.max_seq_len
        if max_seq_len > config.max_position_embeddings:
            log.warning("model %s: max_seq_len %d exceeds the model's %d positions; using %d", self.name,
                        max_seq_len, config.max_position_embeddings, config.max_position_embeddings)
            max_seq_len = config.max_position_embeddings
        model = LlamaModel(config, loaded.tensors, dtype=dtype, device=device)
        del loaded.tensors
        cache = None
        if current is not None and _same_cache_shape(current.cache, config, s.kv_slots, max_seq_len, dtype, device):
            cache = current.cache  # every slot is dropped at the swap; no need for a second cache
        if cache is None:
            need = KVCache.nbytes_for(config, s.kv_slots, max_seq_len, dtype)
            available = _available_memory(device)
            if available is not None and need > MEMORY_HEADROOM * available:
                raise EngineFailure(
                    f"the KV cache for kv_slots={s.kv_slots} x max_seq_len={max_seq_len} needs "
                    f"{need / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB of memory is available; "
                    "lower kv_slots or max_seq_len")
            cache = KVCache(config, s.kv_slots, max_seq_len, dtype, device)
        backend = "torch-cuda" if device.startswith("cuda") else "torch-cpu"
        return _Engine(model, cache, loaded.tokenizer, self.version_label or loaded.version, backend, max_seq_len)

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _engine_main(self, engine: _Engine) -> None:
        from appliance.engine.runner import ModelRunner

        s = self.settings
        if s.threads > 0:
            import torch
            torch.set_num_threads(s.threads)
        self._slots = SlotManager(s.kv_slots, engine.max_seq_len, s.slot_policy)
        self._turns = ChatTurns(engine.tokenizer, s.system_prompt, s.max_text_chars, engine.max_seq_len)
        self._scheduler = Scheduler(self._slots, self._turns, s.prefill_chunk)
        self._runner = ModelRunner(engine.model, engine.cache)
        self._live_engine = engine
        self._pending_swap: tuple[_Engine, _Reply] | None = None
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
        self._drain_commands(block=not sched.has_work and self._pending_swap is None)
        if self._exit:
            return
        with self.liveness.busy():  # scheduling tokenizes prompts: a template stuck in a loop counts too
            if self._pending_swap is not None and not sched.running:
                self._swap()
            plan = sched.schedule()
            for seq, error in plan.failed:
                self._answer(seq, error=error)
            self._running = len(sched.running)
            if not plan.empty:
                self._step(plan)
                self._running = len(sched.running)
        if plan.empty and (sched.has_work or self._pending_swap is not None):
            self._drain_commands(block=True, timeout=IDLE_POLL_S)
        self._publish_slots()

    def _step(self, plan: StepPlan) -> None:
        try:
            sampled = self._runner.run(plan)
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
            if sampled:
                m.tokens_total.labels(self.name, "generated").inc(len(sampled))
            if plan.decode:
                m.batch_size.labels(self.name).observe(len(plan.decode))
            for c in plan.prefill:
                if c.last and c.seq.first_token_at is not None:
                    m.time_to_first_token.labels(self.name).observe(c.seq.first_token_at - c.seq.arrival)
            for seq in finished:
                m.queue_wait.labels(self.name).observe(seq.admitted_at - seq.arrival)
        for seq in finished:
            self._answer_result(seq)

    def _answer_result(self, seq: Sequence) -> None:
        slot = self._slots.slot(seq.slot)
        self._answer(seq, GenerateResult(seq.text, len(seq.generated), seq.finish_reason.value, len(slot.tokens),
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
        elif kind == "cancel":
            seq = item[1]
            if self._scheduler.abort(seq):
                self._answer(seq, error=DeadlineExceeded("the request was cancelled"))
        elif kind == "release":
            session = item[1]
            for seq in self._scheduler.cancel_session(session):
                self._answer(seq, error=NotReady("the session closed"))
            self._slots.release(session)
            self._publish_slots()  # before the reply: a caller reading SlotsInUse next sees the slot free
            if len(item) > 2:
                item[2].send(None)
        elif kind == "swap":
            self._pending_swap = (item[1], item[2])
            self._scheduler.paused = True  # running sequences finish on the old weights first
        elif kind == "stop":
            for seq in self._scheduler.abort_all():
                self._answer(seq, error=NotReady(f"model {self.name} stopped"))
            self._slots.drop_all()
            self._exit = True
            item[2].send(None)

    def _swap(self) -> None:
        engine, reply = self._pending_swap
        self._pending_swap = None
        lost = self._slots.drop_all()  # caches computed by the old weights are meaningless now
        if engine.max_seq_len != self._slots.max_seq_len:
            self._slots.max_seq_len = engine.max_seq_len
        self._turns = ChatTurns(engine.tokenizer, self.settings.system_prompt, self.settings.max_text_chars,
                                engine.max_seq_len)
        self._scheduler.policy = self._turns
        from appliance.engine.runner import ModelRunner
        self._runner = ModelRunner(engine.model, engine.cache)
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
        if self.metrics is not None:  # deltas: several generative models share the two gauges
            self.metrics.kv_slots_total.inc(total - self._slots_total_published)
            self.metrics.kv_slots_used.inc(used - self._slots_used_published)
        self._slots_total_published, self._slots_used_published = total, used

    def _publish_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.labels(self.name).set(self.queue_depth)

    def _publish_loaded(self) -> None:
        if self.metrics is not None and self._engine is not None:
            self.metrics.set_model_info(self.name, self._engine.version, self._engine.backend)


async def _in_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run fn in a thread that ends with it. Not asyncio.to_thread: a pooled thread that once ran torch keeps an idle
    OpenMP team alive, and with more OpenMP threads than cores libgomp stops spin-waiting, which made every matmul of
    the engine thread ~50% slower here (20 -> 30 ms per decode step of the 135M model)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def body() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting coroutine
            result, error = None, exc
        _Reply(loop, future).send(result, error)

    threading.Thread(target=body, name="llm-load", daemon=True).start()
    return await future


def _same_cache_shape(cache: Any, config: Any, n_slots: int, max_seq_len: int, dtype: Any, device: str) -> bool:
    kv = cache.kv
    return (cache.n_slots == n_slots and cache.max_seq_len == max_seq_len and kv.dtype == dtype
            and kv.shape[1] == config.num_hidden_layers and kv.shape[3] == config.num_key_value_heads
            and kv.shape[5] == config.head_dim and str(kv.device).split(":")[0] == device.split(":")[0])


def _available_memory(device: str) -> int | None:
    """Bytes free for a new allocation: MemAvailable on the host, free memory on a GPU."""
    if device.startswith("cuda"):
        import torch
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reason(exc: BaseException) -> str:
    """A reason safe to show a client: our own errors and the loader's ValueErrors (which name files by their
    base name only); anything else only by its type."""
    if isinstance(exc, ApplianceError) or (isinstance(exc, ValueError) and "/" not in str(exc)):
        return str(exc)
    if isinstance(exc, OSError):
        return f"the model files could not be read ({type(exc).__name__})"
    return f"loading failed ({type(exc).__name__})"
