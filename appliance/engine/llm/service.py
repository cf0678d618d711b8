"""One served generative model: what the OPC UA layer calls for `Generate` and `ResetContext`.

An asyncio facade over ONE engine thread (llm_engine.EngineLoop). The thread owns the scheduler, the slots and the
model, and is the only code that touches them; requests and commands cross to it through a thread-safe queue, answers
come back with `loop.call_soon_threadsafe`. The event loop never runs a forward pass.

Per session, calls run in arrival order (an asyncio lock per session): a second Generate of a session waits for the
first, a ResetContext waits for the Generate before it. Deadlines are `time.monotonic()` seconds.
Weights load in a short-lived thread, never in a pooled one (see llm/loading.py in_fresh_thread: an idle OpenMP team in
another long-lived thread makes the engine's matmuls ~50% slower on a 2-core CPU).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

from appliance.engine.llm.sampling import request_seed
from appliance.engine.llm.sequence import Sequence
from core.errors import DeadlineExceeded, EngineFailure, NotReady, ResourceUnavailable
from appliance.engine.liveness import Liveness
from appliance.engine.llm.engine import EngineLoop
from appliance.engine.llm.loading import (LoadedEngine, compile_in_background, in_fresh_thread, load_engine,
                                          load_failure_reason)
from appliance.call_checks import check_generate, check_options
from appliance.engine.llm.choose import ChooseRequest
from appliance.engine.llm.settings import GenerativeSettings
from appliance.engine.llm.thread_reply import Reply
from core.model_port import ChooseResult, GenerateResult
from appliance.engine.model_status import ModelStatus
from appliance.metrics import Metrics

log = logging.getLogger(__name__)


class GenerativeModelService(ModelStatus):
    kind = "generative"

    @classmethod
    def from_settings(cls, name: str, path: Path, s: dict, *, threads: int, version_label: str | None, metrics,
                      on_event, liveness: Liveness) -> "GenerativeModelService":
        """The path's entry, as a worker builds it from the settings the serve process sent (ModelSpec.settings)."""
        return cls(name, Path(path), GenerativeSettings(**{**s, "threads": threads}), version_label=version_label,
                   metrics=metrics, on_event=on_event, liveness=liveness)

    def __init__(self, name: str, path: Path, settings: GenerativeSettings, *, version_label: str | None = None,
                 metrics: Metrics | None = None, on_event: Callable[[str, str], None] | None = None,
                 liveness: Liveness | None = None):
        super().__init__(name, path, version_label=version_label, metrics=metrics, on_event=on_event)
        self.settings = settings
        self.liveness = liveness or Liveness()
        self._engine: LoadedEngine | None = None
        self._engine_loop = EngineLoop(name, settings, metrics=metrics, liveness=self.liveness)
        self._thread: threading.Thread | None = None
        self._compile_thread: threading.Thread | None = None  # engine.compile: auto's background compile
        self._session_locks: dict[str, list] = {}  # session -> [asyncio.Lock, users]
        self._request_counter = 0
        self._outstanding = 0  # Generate calls accepted and not yet answered
        self._one_shots = 0  # one-shot turns so far: each gets a slot key of its own
        self._grammars = None  # grammar.GrammarBook of the served tokenizer, built at the first grammar

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
        return self._engine_loop.slots_in_use

    @property
    def conversations_parked(self) -> int:
        return self._engine_loop.conversations_parked

    @property
    def queue_depth(self) -> int:
        return max(0, self._outstanding - self._engine_loop.running)

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
                engine = await in_fresh_thread(load_engine, self.name, self.path, self.settings, self.version_label,
                                               None)
            except Exception as exc:  # noqa: BLE001 - start never raises: the model is Failed with the reason
                self._log_load_exception("load", exc)
                self._load_failed(load_failure_reason(exc))
                return
            self._engine = engine
            self._thread = threading.Thread(target=self._engine_loop.run, args=(engine,), name=f"llm-{self.name}",
                                            daemon=True)
            self._thread.start()
            self.failure_reason = None
            self._publish_loaded()
            self._set_state("Ready")
            self._compile_thread = compile_in_background(self.name, engine)

    async def reload(self) -> str:
        """New weights from the same path. Sequences running finish on the old weights; then every session's
        conversation is dropped (ContextLost on its next call). A failed load keeps the old weights serving."""
        async with self._reload_lock:
            if self._stopped:
                raise NotReady("the model is stopped")
            try:
                engine = await in_fresh_thread(load_engine, self.name, self.path, self.settings, self.version_label,
                                               self._engine)
            except Exception as exc:  # noqa: BLE001 - a failed reload keeps the old weights serving; logged
                self._log_load_exception("reload", exc)
                reason = load_failure_reason(exc)
                log.error("model %s reload failed: %s", self.name, reason)
                if self._engine is None:
                    self.failure_reason = reason
                self._emit("ModelReloadFailed", reason)
                raise EngineFailure(f"reload failed: {reason}") from None
            if self._thread is None:  # the first load had failed: start serving now
                self._engine = engine
                self._thread = threading.Thread(target=self._engine_loop.run, args=(engine,),
                                                name=f"llm-{self.name}", daemon=True)
                self._thread.start()
            else:
                await self._call_engine(self._engine_loop.swap, engine)
                self._engine = engine
            self.failure_reason = None
            self._publish_loaded()
            self._set_state("Ready")
            self._compile_thread = compile_in_background(self.name, engine)
            log.info("model %s now serves version %s on %s", self.name, engine.version, engine.backend)
            return engine.version

    async def stop(self) -> None:
        """Answer every waiting and running request NotReady, free all slots, end the engine thread."""
        self._stopped = True
        if self._thread is not None and self._thread.is_alive():
            await self._call_engine(self._engine_loop.stop)
            await asyncio.to_thread(self._thread.join, 10.0)
        self._thread = None
        if self.metrics is not None:
            self.metrics.model_ready.labels(self.name).set(0)

    # ---- requests ------------------------------------------------------------------------------------------
    async def generate(self, session_key: str, prompt: str, max_tokens: int, temperature: float,
                       deadline: float, on_progress=None, finish_by: float | None = None,
                       grammar: str | None = None) -> GenerateResult:
        """on_progress(text, tokens), on the loop, after each engine step that added to the reply (jobs).
        finish_by (a job's bound, monotonic): the reply ends there with FinishReason `deadline` and what it has;
        `deadline` then only guards against an engine that does not answer. session_key "": a one-shot turn (no
        history; its slot is given back when it ends). grammar: a JSON Schema the reply must match
        (model_port.GenerativeModel.generate); InvalidArgument if it cannot be compiled."""
        started = time.monotonic()
        self.request_count += 1
        try:
            result = await self._generate(session_key, prompt, max_tokens, temperature, deadline, on_progress,
                                          finish_by, grammar)
        except BaseException:  # a cancelled call (client gone) counts too: the model did not answer it
            self.error_count += 1
            raise
        self.last_latency_ms = (time.monotonic() - started) * 1000.0
        return result

    async def _generate(self, session_key: str, prompt: str, max_tokens: int, temperature: float,
                        deadline: float, on_progress=None, finish_by: float | None = None,
                        grammar: str | None = None) -> GenerateResult:
        prompt = self._validate(prompt, max_tokens, temperature)
        self._require_ready()
        constraint = await self._constraint(grammar) if grammar else None
        if self.queue_depth >= self.settings.max_queue_size:
            raise ResourceUnavailable("the model's queue is full")
        one_shot = session_key == ""
        if one_shot:  # a key of its own, never a session's (those are never empty and have no NUL)
            self._one_shots += 1
            session_key = f"\0once:{self._one_shots}"
        self._outstanding += 1
        self._publish_queue()
        try:
            async with self._session_turn(session_key, deadline if finish_by is None else finish_by):
                self._require_ready()
                self._request_counter += 1
                seq = Sequence(session_key=session_key, prompt=prompt, max_tokens=int(max_tokens),
                               temperature=float(temperature), top_p=self.settings.top_p,
                               seed=request_seed(self.settings.seed, self._request_counter), deadline=deadline,
                               finish_at=math.inf if finish_by is None else finish_by, constraint=constraint,
                               one_shot=one_shot)
                loop = asyncio.get_running_loop()
                seq.handle = Reply(loop, loop.create_future(), on_progress)
                self._engine_loop.submit(seq)
                try:
                    done, _ = await asyncio.wait({seq.handle.future}, timeout=max(0.0, deadline - time.monotonic()))
                except asyncio.CancelledError:
                    self._engine_loop.cancel(seq)
                    seq.handle.future.cancel()  # nobody will read the engine's answer
                    raise
                if not done:
                    self._engine_loop.cancel(seq)  # the engine rolls the slot back to before this turn
                    seq.handle.future.cancel()
                    raise DeadlineExceeded("the request's deadline passed")
                return seq.handle.future.result()
        except DeadlineExceeded:
            if finish_by is None or time.monotonic() < finish_by:
                raise
            # a job still waiting for an earlier turn of its conversation at its bound: it ends empty
            return GenerateResult("", 0, "deadline", 0, False, self.version)
        finally:
            self._outstanding -= 1
            self._publish_queue()

    async def _constraint(self, schema: str):
        """A fresh matcher of `schema` for one sequence. The grammar engine's tokenizer (built from the served
        tokenizer, ~0.2 s) and a schema's first compilation run in a thread, off the event loop."""
        engine = self._engine
        book = self._grammars
        if book is None or book.source is not engine.tokenizer:
            from appliance.engine.llm.grammar import GrammarBook
            eos = set(engine.tokenizer.eos_token_ids) | engine.tokenizer.end_of_turn_ids()
            book = await asyncio.to_thread(GrammarBook, engine.tokenizer, engine.model.config.vocab_size, eos)
            self._grammars = book
        if book.is_compiled(schema):
            return book.constraint(schema)
        return await asyncio.to_thread(book.constraint, schema)

    async def choose(self, prompt: str, options: list[str], deadline: float) -> ChooseResult:
        """Each option scored as the whole reply to `prompt` in a turn of no conversation (model_port's
        GenerativeModel.choose); InvalidArgument for a bad prompt or option (its index)."""
        started = time.monotonic()
        self.request_count += 1
        try:
            prompt = check_generate(prompt, 1, 0.0, 1)
            options = check_options(options)
            self._require_ready()
            if self.queue_depth >= self.settings.max_queue_size:
                raise ResourceUnavailable("the model's queue is full")
            self._outstanding += 1
            self._publish_queue()
            try:
                request = ChooseRequest(prompt, options, deadline)
                loop = asyncio.get_running_loop()
                request.handle = Reply(loop, loop.create_future())
                self._engine_loop.choose(request)
                try:
                    done, _ = await asyncio.wait({request.handle.future},
                                                 timeout=max(0.0, deadline - time.monotonic()))
                except asyncio.CancelledError:
                    request.handle.future.cancel()  # the engine drops it if it has not run yet
                    raise
                if not done:
                    request.handle.future.cancel()
                    raise DeadlineExceeded("the request's deadline passed")
                result = request.handle.future.result()
            finally:
                self._outstanding -= 1
                self._publish_queue()
        except BaseException:
            self.error_count += 1
            raise
        self.last_latency_ms = (time.monotonic() - started) * 1000.0
        return result

    async def reset(self, session_key: str) -> None:
        """Forget the session's conversation and give its slot back (after its earlier calls)."""
        self._require_ready()
        async with self._session_turn(session_key, math.inf):
            await self._call_engine(self._engine_loop.release, session_key)

    def release(self, session_key: str) -> None:
        """The session closed or timed out: cancel its calls, free its slot. Thread-safe, idempotent."""
        if self._thread is not None:
            self._engine_loop.release(session_key)

    # ---- event-loop helpers --------------------------------------------------------------------------------
    def _validate(self, prompt: Any, max_tokens: Any, temperature: Any) -> str:
        """The prompt as it will be tokenized (NFKC, LF line ends), or InvalidArgument naming the argument."""
        return check_generate(prompt, max_tokens, temperature, self.settings.max_new_tokens)

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

    async def _call_engine(self, command: Callable[..., None], *args: Any) -> Any:
        """Send an EngineLoop command that takes a Reply last; wait for the engine thread's answer."""
        loop = asyncio.get_running_loop()
        reply = Reply(loop, loop.create_future())
        command(*args, reply)
        return await reply.future

    # ---- publishing ----------------------------------------------------------------------------------------
    def _publish_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.labels(self.name).set(self.queue_depth)

    def _publish_loaded(self) -> None:
        if self.metrics is not None and self._engine is not None:
            self.metrics.set_model_info(self.name, self._engine.version, self._engine.backend)

