"""One served tensor model: its backend, its dynamic batcher, its state, counters and hot reload.

The backend and its version live in one `_Loaded` reference. Each batch reads that reference once, so a reload
swaps weights atomically: batches already running finish on the old weights and report the old version.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from appliance.engine.tensor.batcher import BatchPolicy, DynamicBatcher
from appliance.engine.tensor.backends import TensorBackend, load_tensor_backend
from appliance.call_checks import check_samples
from core.errors import ApplianceError, EngineFailure, NotReady
from appliance.engine.liveness import Liveness
from appliance.engine.model_status import ModelStatus
from appliance.metrics import Metrics
from loader.file_digest import VERSION_CHARS, content_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Loaded:
    backend: TensorBackend
    version: str


class TensorModelService(ModelStatus):
    kind = "tensor"

    @classmethod
    def from_settings(cls, name: str, path: Path, s: dict, *, threads: int, version_label: str | None, metrics,
                      on_event, liveness: Liveness, inline: bool) -> "TensorModelService":
        """The path's entry, as a worker builds it from the settings the serve process sent (ModelSpec.settings)."""
        policy = BatchPolicy(max_batch_size=s["max_batch_size"], max_queue_delay_s=s["max_queue_delay_s"],
                             max_queue_size=s["max_queue_size"])
        tensorrt = None
        if s["backend"] == "tensorrt":
            from appliance.engine.tensor.tensorrt_backend import TensorRtSettings
            tensorrt = TensorRtSettings(cache_dir=Path(s["tensorrt_cache_dir"]), max_batch_size=s["max_batch_size"],
                                        fp16=s["tensorrt_fp16"])
        return cls(name, Path(path), backend=s["backend"], device=s["device"], threads=threads,
                   version_label=version_label, max_samples=s["max_samples"], policy=policy, metrics=metrics,
                   on_event=on_event, liveness=liveness, inline=inline, tensorrt=tensorrt)

    def __init__(self, name: str, path: Path, *, backend: str, device: str, threads: int, version_label: str | None,
                 max_samples: int, policy: BatchPolicy, metrics: Metrics | None,
                 on_event: Callable[[str, str], None] | None = None, liveness: Liveness | None = None,
                 inline: bool = False, tensorrt=None):
        super().__init__(name, path, version_label=version_label, metrics=metrics, on_event=on_event)
        self.liveness = liveness or Liveness()
        self.tensorrt = tensorrt  # TensorRtSettings for backend tensorrt (engine cache, batch profile)
        self.backend_choice = backend
        self.device = device
        self.threads = threads
        self.max_samples = max_samples
        self.policy = policy
        self._loaded: _Loaded | None = None
        # One inference thread per model: the batcher runs one batch at a time; loads use other threads. `inline`
        # (in a worker process of its own): a lone request of a fast model runs on the worker's loop; a batch that
        # hangs there is seen the same way, as liveness checks left unanswered.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"infer-{name}")
        self._batcher = DynamicBatcher(name, policy, self._execute, metrics, self._executor, inline_fast_path=inline)

    # ---- what the address space shows ----

    @property
    def version(self) -> str:
        return self._loaded.version if self._loaded else ""

    @property
    def backend_name(self) -> str:
        return self._loaded.backend.name if self._loaded else ""

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self._loaded.backend.input_shape) if self._loaded else ()

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self._loaded.backend.output_shape) if self._loaded else ()

    def shed_load(self, on: bool) -> None:
        """The GPU watchdog is Critical: batches of at most half the configured size (less heat and memory), until
        it is not."""
        import dataclasses
        size = max(1, self.policy.max_batch_size // 2) if on else self.policy.max_batch_size
        self._batcher.policy = dataclasses.replace(self.policy, max_batch_size=size)

    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth

    # ---- life cycle ----

    async def start(self) -> None:
        """Load the weights in a thread. Ends Ready or Failed; never raises."""
        async with self._reload_lock:
            self._set_state("Loading")
            try:
                self._loaded = await asyncio.to_thread(self._load)
            except Exception as exc:  # noqa: BLE001 - start never raises: the model is Failed with the reason
                self._log_load_exception("load", exc)
                self._load_failed(_reason(exc))
                return
            self.failure_reason = None
            self._publish_loaded()
            self._set_state("Ready")

    async def reload(self) -> str:
        """Load the weights anew from the same path and swap them in; returns the version now serving.

        A failed load leaves the old weights serving (state unchanged), calls on_event("ModelReloadFailed", reason)
        and raises EngineFailure with the reason.
        """
        async with self._reload_lock:
            if self._stopped:
                raise NotReady("the model is stopped")
            try:
                loaded = await asyncio.to_thread(self._load)
                if self._loaded is not None:
                    _check_same_shapes(self._loaded.backend, loaded.backend)
            except Exception as exc:  # noqa: BLE001 - any failed reload leaves the old weights serving; logged
                self._log_load_exception("reload", exc)
                reason = _reason(exc)
                log.error("model %s reload failed, %s: %s", self.name,
                          "old weights keep serving" if self._loaded else "still not loaded", reason)
                if self._loaded is None:
                    self.failure_reason = reason
                self._emit("ModelReloadFailed", reason)
                raise EngineFailure(f"reload failed: {reason}") from None
            self._loaded = loaded  # the swap: the next batch to start uses it
            self.failure_reason = None
            self._publish_loaded()
            self._set_state("Ready")
            log.info("model %s now serves version %s on %s", self.name, loaded.version, loaded.backend.name)
            return loaded.version

    async def stop(self) -> None:
        self._stopped = True
        await self._batcher.close()
        self._executor.shutdown(wait=False)
        if self.metrics is not None:
            self.metrics.model_ready.labels(self.name).set(0)

    # ---- inference ----

    async def infer(self, flat: np.ndarray, deadline: float) -> tuple[np.ndarray, str]:
        """k samples back to back in a 1-D array -> (k results back to back, the version that computed them)."""
        started = time.monotonic()
        self.request_count += 1
        try:
            samples = self._validate(flat)
            outputs, version = await self._batcher.submit(samples, deadline)
        except Exception:  # counted, then re-raised; a cancelled call (client gone) is no error of the model
            self.error_count += 1
            raise
        return self._answered(outputs, version, started)

    def infer_now(self, flat: np.ndarray, deadline: float) -> tuple[np.ndarray, str] | None:
        """`infer` done at once on the caller's thread where the batcher's inline fast path takes the request;
        None (nothing counted, nothing run) where it would have to wait for the batcher: call `infer` then."""
        started = time.monotonic()
        try:
            samples = self._validate(flat)
            answer = self._batcher.submit_now(samples, deadline)
        except Exception:  # counted, then re-raised, as in infer
            self.request_count += 1
            self.error_count += 1
            raise
        if answer is None:
            return None
        self.request_count += 1
        return self._answered(*answer, started)

    def _answered(self, outputs: np.ndarray, version: str, started: float) -> tuple[np.ndarray, str]:
        self.last_latency_ms = (time.monotonic() - started) * 1000.0
        return np.ascontiguousarray(outputs, dtype=np.float32).reshape(-1), version

    def _validate(self, flat: np.ndarray) -> np.ndarray:
        loaded = self._loaded
        if self._stopped or self.state != "Ready" or loaded is None:
            raise NotReady(f"model {self.name} is not Ready")
        return check_samples(flat, loaded.backend.input_shape, self.max_samples)

    def _execute(self, batch: np.ndarray) -> tuple[np.ndarray, str]:
        loaded = self._loaded  # read once per batch: a reload during the run does not touch this batch
        with self.liveness.busy():
            return loaded.backend.run(batch), loaded.version

    # ---- helpers ----

    def _load(self) -> _Loaded:
        """In a worker thread: the version is hashed before loading, so it names the bytes that were loaded
        unless the file is replaced in between (replace files atomically: write beside, then rename)."""
        version = self.version_label or content_digest(self.path)[:VERSION_CHARS]
        backend = load_tensor_backend(self.path, self.backend_choice, self.device, self.threads,
                                      tensorrt=self.tensorrt, timing_batch=self.policy.max_batch_size)
        return _Loaded(backend, version)

    def _publish_loaded(self) -> None:
        if self.metrics is not None:
            self.metrics.set_model_info(self.name, self._loaded.version, self._loaded.backend.name)


def _check_same_shapes(old: TensorBackend, new: TensorBackend) -> None:
    # PLC programs have fixed-size arrays for Input and Output: a shape change needs a restart, not a hot swap.
    if tuple(old.input_shape) != tuple(new.input_shape) or tuple(old.output_shape) != tuple(new.output_shape):
        raise EngineFailure(f"the new weights change the sample shapes ({list(old.input_shape)} -> "
                            f"{list(new.input_shape)}, {list(old.output_shape)} -> {list(new.output_shape)}); "
                            "restart the appliance to serve a model of another shape")


def _reason(exc: BaseException) -> str:
    """A reason safe to show a client: our own errors carry path-free messages; anything else only its type."""
    if isinstance(exc, ApplianceError):
        return str(exc)
    if isinstance(exc, OSError):
        return f"the model file could not be read ({type(exc).__name__})"
    return f"loading failed ({type(exc).__name__})"
